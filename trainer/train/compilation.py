"""Which parts of the drafter's training step run under `torch.compile`, and where.

On a GPU the eager step waits on the host: at the seed recipe's shapes on an H200, compiling the decoder layers, the
flex masks and the teacher's full-vocabulary reduction, together with the recipe's GPU-sized loss chunks and aligned
full-vocabulary chunks, took the step from 0.2530 s to 0.1157 s (benchmarks/RESULTS.md). The masks and the reduction are compiled where they are built
(`modeling_dspark.build_attention_mask`, `trainer.verifier.teacher`, each through `modeling_dspark.CompiledOrEager`);
the decoder layers are compiled here, once, when the trainer builds the drafter (`model.compile_layers`).
"""

import torch

from modeling_dspark import DSparkDraftModel


def compile_layers_enabled(setting: bool | None, device) -> bool:
    """`model.compile_layers`: None (auto) compiles on a GPU, where it was measured to pay (benchmarks/RESULTS.md);
    on a CPU it stays off unless asked for: no benchmark has measured it there."""
    return torch.device(device).type == "cuda" if setting is None else bool(setting)


def compile_decoder_layers(drafter: DSparkDraftModel) -> None:
    """`torch.compile` each draft decoder layer in place (`nn.Module.compile`: parameter names, checkpoints and
    the exported folder are unchanged). Regional rather than whole-model: the layers are one graph per layer type
    with the flex attention call fused in, while the forward around them (anchors, masks, the Markov features)
    keeps its data-dependent Python. On the H200 at the seed recipe's shapes this took the backward from 33 to
    23 ms and the step's peak memory from 9.99 to 8.88 GiB (benchmarks/RESULTS.md)."""
    for layer in drafter.layers:
        layer.compile()
