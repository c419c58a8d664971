"""Export: a checkpoint -> a servable Hub folder with its model card, validated before anything leaves
(against the checkpoint contract, trainer/contract.py).

    staging.py        the staged folder (`stage`), written from one checkpoint
    card.py           the model card, rendered into `card.md`
    card_sections.py  its sections, each from `CardInputs` alone
    card_usage.py     its usage section: serving with vLLM, decoding in process
    plots.py          the plots the card embeds
    gguf.py           a checkpoint and its verifier as llama.cpp GGUF files, checked by serving them
"""
