"""The run's data path, from the `data` section of a run config to tokenised train and validation conversations.
Training (trainer/run.py) and the offline cache writer (trainer/states/cache_cli.py) both call `prepare_data`, so
the cache holds exactly the documents training asks for.
"""


import logging

from trainer.config import RunConfig  # noqa: E402
from trainer.data.load import load_chat_dataset
from trainer.data.render import prepare_conversations, split_train_validation
from trainer.errors import UsageError  # noqa: E402

logger = logging.getLogger("dspark")

def prepare_data(config: RunConfig, tokenizer):
    """Load, render, tokenise (cached) and split the chat data: `(train_set, validation_set, stats)`. The one
    path from the data section to conversations, shared with the hidden-state cache writer
    (trainer/states/cache_format.py) so the cache holds exactly the documents training will ask for."""
    d = config.data
    raw = load_chat_dataset(d.train_data, split=d.train_split, max_samples=d.max_samples,
                            max_bad_line_ratio=d.max_bad_line_ratio)
    tokenized, stats = prepare_conversations(raw, tokenizer, d.max_seq_length, num_proc=d.num_proc)
    logger.info("data: %s", stats.summary())
    train_set, validation_set = split_train_validation(tokenized, d.validation_ratio, d.split_seed)
    return train_set, validation_set, stats


def len_vocab(verifier_path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(verifier_path).get_text_config().vocab_size


def check_enough_supervision(train_set, block_size: int) -> None:
    supervised = sum(train_set["num_supervised"]) if len(train_set) else 0
    if supervised < block_size:
        raise UsageError(f"the training split has {supervised} supervised tokens, fewer than one block of "
                         f"{block_size}; add conversations with assistant turns or lower model.block_size.")
