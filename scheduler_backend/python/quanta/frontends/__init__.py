"""Ways in: the offline Python API, the Triton backend glue and the OpenAI gateway."""
