"""`python -m kvferry.model.tp_rank JSON`: one rank of a tensor-parallel group
(kvferry/model/tp_group.py `follow`), started by a process that does not fork from its
worker: the test suite's zygote (deploy/zygote.py), which forks it with torch imported
already instead of the fresh interpreter multiprocessing would start."""

from __future__ import annotations

import sys

from kvferry.model.tp_group import follow_args

if __name__ == "__main__":
    follow_args(sys.argv[1])
