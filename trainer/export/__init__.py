"""Export: a checkpoint -> a servable Hub folder with its model card, validated before anything leaves.

    contract.py       what a servable DSpark folder holds and the checks that prove it serves
    staging.py        the staged folder (`stage`), written from one checkpoint
    card.py           the model card, rendered into `card.md`
    card_sections.py  its sections, each from `CardInputs` alone
    plots.py          the plots the card embeds
"""
