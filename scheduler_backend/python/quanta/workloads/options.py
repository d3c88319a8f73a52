"""The command-line options every tool that reads a workload file shares (Typer), so that
``quanta simulate``, ``quanta bench serve`` and ``quanta bench workload`` spell and explain
them alike. Locust's argparse options in ``loadtests/locustfile.py`` mirror them.
"""

from __future__ import annotations

from typing import Annotated

import typer

from quanta.workloads.transforms import TooLong

TimeScaleOpt = Annotated[
    float,
    typer.Option(
        help="divide a workload file's inter-arrival times by this (2: twice as fast)",
    ),
]
TokenScaleOpt = Annotated[
    float,
    typer.Option(
        help="multiply a workload file's prompt (context) tokens by this (rounded, >= 1)",
    ),
]
TooLongOpt = Annotated[
    TooLong,
    typer.Option(
        help="a file's rows with prompt + output > the model's length: error, skip them, "
        "or clip them (shorten the prompt, and the output if it alone does not fit)",
    ),
]
