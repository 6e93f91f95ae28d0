"""``exitlm bench``: exitlm's decoding strategies against each other and against
``transformers`` on the same prompts (:mod:`.run`), and its command (:mod:`.cli`)."""
