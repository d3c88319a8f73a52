"""Text in and out of a checkpoint: its tokenizer and its chat template.

Below both the frontends and ``quanta build`` (the gateway renders prompts with these, the
build checks that they load), so neither has to import the other for them; torch-free.
"""
