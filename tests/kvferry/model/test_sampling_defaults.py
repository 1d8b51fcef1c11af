"""An unset sampling field takes the model's default: the checkpoint's
generation_config.json, then the router's --override-generation-config, else kvferry's; a
request's own value, greedy included, always wins. The default model, served without
--model, samples as its model card says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deploy.default_model import DEFAULT_MODEL_SAMPLING
from deploy.launcher import Deployment
from kvferry.model.config import load_model_config
from kvferry.rpc.convert import sampling_from_proto
from kvferry.settings.sampling import KVFERRY_DEFAULTS, SamplingDefaults
from kvferry.v1 import generation_pb2
from router.http.schema import ChatCompletionRequest


def test_generation_config_fields_and_overrides() -> None:
    got = SamplingDefaults.from_generation_config(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2})
    assert got == SamplingDefaults(0.6, 0.95, 20)
    assert SamplingDefaults.from_generation_config({"eos_token_id": 2}) == KVFERRY_DEFAULTS
    assert SamplingDefaults.from_generation_config({"top_k": -1}).top_k == 0  # off
    assert got.overridden('{"temperature": 0}') == SamplingDefaults(0.0, 0.95, 20)
    for bad, word in (('{"temp": 1}', "unknown key 'temp'"), ("[1]", "JSON object"),
                      ("{", "not JSON"), ('{"top_p": 2}', "top_p in (0, 1]"),
                      ('{"temperature": "hot"}', "must be a number")):
        with pytest.raises(ValueError, match="override_generation_config") as exc:
            KVFERRY_DEFAULTS.overridden(bad)
        assert word in str(exc.value)


def test_unset_fields_take_the_defaults_and_set_ones_win() -> None:
    defaults = SamplingDefaults(0.2, 0.9, 7)
    unset = sampling_from_proto(generation_pb2.SamplingParams(), defaults=defaults)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.2, 0.9, 7)
    greedy = sampling_from_proto(generation_pb2.SamplingParams(temperature=0.0, top_k=0),
                                 defaults=defaults)
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 0.9, 0)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = body.to_input("r", defaults).params
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.5, 7)
    assert body.to_input("r").params.temperature == 1.0  # no model defaults: kvferry's


def test_the_checkpoint_and_the_override_set_the_routers_defaults(qwen3_checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    assert load_model_config(qwen3_checkpoint).sampling_defaults == KVFERRY_DEFAULTS
    model = tmp_path / "with-sampling"
    shutil.copytree(qwen3_checkpoint, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**config, "do_sample": True, "temperature": 0.7, "top_k": 40}))
    assert load_model_config(model).sampling_defaults == SamplingDefaults(0.7, 1.0, 40)
    assert load_model_config(model, '{"top_p": 0.8}').sampling_defaults == \
        SamplingDefaults(0.7, 0.8, 40)


def test_the_default_model_samples_as_its_card_says() -> None:
    card = ["--override-generation-config", DEFAULT_MODEL_SAMPLING]
    assert json.loads(DEFAULT_MODEL_SAMPLING) == {"temperature": 0.2, "top_p": 0.9}
    default = Deployment(model=None)._router_args("127.0.0.1", {})
    assert default[-2:] == card
    given = Deployment(model="/models/m")._router_args("127.0.0.1", {})
    assert "--override-generation-config" not in given
    from deploy import cli
    from deploy.args import build_parser

    for command in ("serve", "demo"):  # without --model: the launcher picks the default model
        args = cli._deployment(build_parser().parse_args([command]))._router_args(
            "127.0.0.1", {})
        flag = args.index("--override-generation-config")
        assert args[flag:flag + 2] == card
    own = ["--override-generation-config", '{"temperature": 1}']
    mine = Deployment(model=None, router_args=own)._router_args("127.0.0.1", {})
    assert mine.count("--override-generation-config") == 1 and own[1] in mine
