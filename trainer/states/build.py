"""The hidden-state source a run config names (`train.hidden_states`: in_process, vllm, cache or hybrid), built and
checked before the first step, and its report and shutdown. Training and the cache writer build sources here.
"""


import logging

from trainer.config import RunConfig  # noqa: E402
from trainer.states.in_process import InProcessVerifier  # noqa: E402
from trainer.states.source import HiddenStateSource  # noqa: E402
from trainer.states.vllm import VLLMStateSource  # noqa: E402
from trainer.states.vllm import source_for_config as vllm_source_for_config  # noqa: E402
from trainer.verifier.teacher import verifier_teacher  # noqa: E402

logger = logging.getLogger("dspark")


def build_source(config: RunConfig, verifier, aux_layer_ids: list[int], rank: int = 0,
                 world_size: int = 1) -> HiddenStateSource:
    """The hidden-state source `train.hidden_states` names (trainer/states/source.py has the table). Online
    sources are checked here, before any training step: servers up, serving this verifier, extracting these
    layers into a directory this machine sees."""
    t = config.train
    if t.hidden_states == "in_process":
        return InProcessVerifier(verifier, aux_layer_ids, max_tokens_per_forward=t.verifier_max_tokens_per_forward)
    online = None
    if t.hidden_states in ("vllm", "hybrid"):
        online = vllm_source_for_config(config, verifier, aux_layer_ids, rank, world_size)
        if t.hidden_states == "vllm":
            return online
    from trainer.states.hybrid import HybridSource
    from trainer.states.offline_cache import OfflineCache

    cache = OfflineCache(t.states_cache_dir, teacher=verifier_teacher(verifier), aux_layer_ids=aux_layer_ids)
    return cache if online is None else HybridSource(cache, online)


def source_report(source: HiddenStateSource) -> dict:
    """What the summary records of where the states came from (the hybrid's shares, the servers' counters)."""
    report = {"source": type(source).__name__}
    if hasattr(source, "report"):
        logger.info("%s", source.report())
        report["report"] = source.report()
    if hasattr(source, "share"):
        report["cached_token_share"] = source.share()
    for part in (source, getattr(source, "fallback", None)):
        if isinstance(part, VLLMStateSource):
            report["vllm"] = dict(part.stats)
    return report


def close_source(source: HiddenStateSource) -> None:
    """Stop a source's background requests (an online one, or the one behind a hybrid cache)."""
    for part in (source, getattr(source, "fallback", None)):
        if hasattr(part, "close"):
            part.close()
