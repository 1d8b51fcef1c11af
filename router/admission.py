"""A public request admitted: validated once at the edge and turned into the one record its
legs read (`Admitted`, router/request.py): its prompt ids, sampling, stop ids, deadline and
cache namespace. Every bad field is refused here with InvalidArgument naming it, before
anything is reserved or sent downstream: sizes first (router/validation.py,
router/prompt_bounds.py), then the prompt tokenized or rendered off the event loop, then
sampling resolved against the prompt's length."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from kvferry.cache.budget import KvBudget
from kvferry.model.config import ModelConfig
from kvferry.settings.limits import PublicLimits
from router import validation
from router.identity import Caller, tenant_salt
from router.prompt_bounds import PromptBounds, check_prompt_bounds
from router.request import Admitted
from router.validation import GenerateInput

TOKENIZE_QUEUE = 2  # prompts queued on the tokenizer thread at once


class Admission:
    def __init__(self, config: ModelConfig, tokenizer: object, limits: PublicLimits,
                 kv_budget: KvBudget) -> None:
        self.config, self.tokenizer, self.limits = config, tokenizer, limits
        self.kv_budget = kv_budget
        self.prompt_bounds = PromptBounds.of(tokenizer)  # sizes refused before tokenizing
        # Tokenization and chat templates run here, one at a time, off the event loop.
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # Prompts handed to that thread at once: the rest wait here, where a client that
        # leaves costs nothing, instead of in the executor's unbounded queue.
        self._tokenize_slots = asyncio.Semaphore(TOKENIZE_QUEUE)

    async def admit(self, inp: GenerateInput, timeout_s: float | None, caller: Caller
                    ) -> Admitted:
        """The request's record; InvalidArgument naming the first bad field."""
        received = time.perf_counter()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        config = self.config
        validation.check_limits(inp, config, self.limits)
        check_prompt_bounds(inp, config.max_position_embeddings, self.limits,
                            self.prompt_bounds)
        if inp.token_ids is not None:  # no tokenizer work: checked right here
            prompt = validation.prompt_ids(inp, config, self.tokenizer)
        else:
            async with self._tokenize_slots:
                prompt = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize, validation.prompt_ids, inp, config, self.tokenizer)
        params = validation.resolve_sampling(inp, config, len(prompt), self.limits,
                                             self.kv_budget.is_bounded)
        return Admitted(inp.request_id, prompt, params,
                        tuple(validation.stop_ids(params, config)), received, deadline,
                        tenant_salt(caller.tenant, inp.cache_salt))
