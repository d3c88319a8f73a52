"""The options every way of starting Quanta reads: ``quanta serve``, ``quanta openai``,
``quanta simulate`` and their ``--config`` files (``models`` says what each option means;
``cli`` derives the command-line options; ``docs`` renders the docs' option tables)."""

from quanta.config.models import CacheArgs, EngineArgs, SchedulerArgs, ServingArgs

__all__ = ["CacheArgs", "EngineArgs", "SchedulerArgs", "ServingArgs"]
