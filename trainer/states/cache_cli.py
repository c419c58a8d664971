"""The offline-cache command: compute the verifier states of every document a run config trains on and write them
to a cache directory (trainer/states/cache_format.py has its layout), with the in-process verifier or the vLLM
servers the config names.

    python -m trainer states-cache --config configs/smollm2-135m.yaml --cache_dir DIR [--shard_tokens N] [--key value]
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from trainer.config import aux_layer_ids_for_config
from trainer.errors import Parser, UsageError, run_cli
from trainer.states.cache_format import DEFAULT_SHARD_TOKENS, check_plan, dtype_name, make_plan
from trainer.states.offline_cache import as_document, write_cache

logger = logging.getLogger("dspark")


# ---------------------------------------------------------------------------------------------------- command
def documents_for_config(config) -> list[torch.Tensor]:
    """Every document a run of `config` trains or evaluates on (train and validation conversations, each one's
    `input_ids`), through the run's own data path (`trainer.data.prepare.prepare_data`), so their keys are the ones
    training asks for."""
    import numpy as np
    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    from trainer.data.prepare import prepare_data
    from trainer.verifier.loading import resolve_pretrained

    path, _ = resolve_pretrained(config.model.verifier, "verifier")
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_set, validation_set, _ = prepare_data(config, tokenizer)
    documents = []
    for split in (train_set, validation_set):
        if len(split) == 0:
            continue
        table = split.select_columns(["input_ids"]).with_format("arrow")
        for batch in table.iter(batch_size=4096):
            column = batch.column("input_ids")
            values = pc.list_flatten(column).to_numpy().astype(np.int64)
            ends = np.cumsum(pc.list_value_length(column).to_numpy())
            documents.extend(torch.from_numpy(v.copy()) for v in np.split(values, ends[:-1]))
    return documents


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's own flags (`--config`, `--cache_dir`, `--shard_tokens`, `--source`, `--full_vocabulary`);
    everything else overrides the run config, as for training."""
    parser = Parser(prog="python -m trainer states-cache", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="the run config whose documents are cached")
    parser.add_argument("--cache_dir", default=None, help="the directory to write the cache into")
    parser.add_argument("--shard_tokens", default=DEFAULT_SHARD_TOKENS, type=int,
                        help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS})")
    parser.add_argument("--source", choices=("in_process", "vllm"), default="in_process",
                        help="in_process: the verifier here; vllm: the servers of the run config's train.vllm_urls")
    parser.add_argument("--full_vocabulary", choices=("true", "false"), default="true",
                        help="also store the verifier's full-vocabulary log-normaliser and argmax per position, which "
                             "the default objective otherwise computes every step (default true; false saves its pass "
                             "over the verifier's whole head where that runs on a slow device, e.g. a CPU host writing "
                             "states from vLLM servers)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    config_path, cache_dir, shard_tokens, source_name = args.config, args.cache_dir, args.shard_tokens, args.source
    if not cache_dir:
        raise UsageError("no --cache_dir was given; pass the directory to write the cache into, e.g. --cache_dir "
                         "out/states-cache.")
    from trainer.config import RunConfig
    from trainer.states.build import build_source
    from trainer.verifier.loading import load_verifier, load_verifier_shell, resolve_pretrained, torch_dtype

    config = RunConfig.load(config_path, rest)
    path, verifier_config = resolve_pretrained(config.model.verifier, "verifier")
    aux_layer_ids = aux_layer_ids_for_config(config, verifier_config)
    documents = [as_document(d) for d in documents_for_config(config)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch_dtype(config.model.verifier_dtype, device)
    hidden_size = verifier_config.get_text_config().hidden_size
    # a cache planned differently is refused before the verifier is loaded (minutes for a large one on a GPU)
    full_vocabulary = args.full_vocabulary == "true"
    check_plan(cache_dir, make_plan(documents, aux_layer_ids, hidden_size, dtype_name(dtype), shard_tokens,
                                    full_vocabulary=full_vocabulary))
    if source_name == "vllm":
        t = config.train
        if not (t.vllm_urls and t.vllm_states_dir):
            raise UsageError("--source vllm needs the servers: pass --vllm_urls '[http://host:port]' and "
                             "--vllm_states_dir DIR (or set them in the config's train section).")
        verifier = load_verifier_shell(path, config.model.verifier_dtype, device)
    else:
        logger.info("loading the verifier %s (%s)", config.model.verifier, path)
        verifier = load_verifier(path, dtype=config.model.verifier_dtype, device=device)
    config.train.hidden_states = source_name  # the same source a training run of this config would build
    source = build_source(config, verifier, aux_layer_ids)
    return write_cache(source, documents, cache_dir, shard_tokens=shard_tokens,
                       tokens_per_call=config.train.verifier_max_tokens_per_forward,
                       full_vocabulary=full_vocabulary, chunk_elements=config.train.loss_chunk_elements)


if __name__ == "__main__":
    sys.exit(run_cli(main))
