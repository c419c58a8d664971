"""The model card of an exported drafter, rendered from data only.

Every number in the card is read from what `trainer/export/staging.py` hands over in `CardInputs`: the staged
`config.json` and weights, the checkpoint's saved run configuration, data statistics and trainer state, the run
summary, the confidence calibration record (`CALIBRATION_FILE`, trainer/train/calibration.py), and the
`dspark-acceptance/1` results files (`trainer/evaluation/results.py`). Each `*_section` function renders one
section of the template `model_card.md` (next to this file); `card_metadata` is the YAML front matter (base model,
tags, training datasets, `model-index` evaluation results); `render_card` fills the template with
`huggingface_hub.ModelCard.from_template`.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from trainer.evaluation.results import is_hub_dataset
from trainer.export.card_sections import (
    CardInputs,
    _train_datasets,
    architecture_section,
    evaluation_section,
    limitations_section,
    provenance_section,
    summary_section,
    training_section,
)
from trainer.export.card_usage import usage_section

TEMPLATE_FILE = Path(__file__).with_name("card.md")






def card_metadata(inputs: CardInputs) -> ModelCardData:
    tags = ["speculative-decoding", "dspark", "speculators", "draft-model"]
    family = (inputs.config.get("verifier_text_config") or {}).get("model_type")
    if isinstance(family, str) and family and family not in tags:
        tags.append(family.removesuffix("_text"))
    evals = []
    for r in inputs.results:
        hub = is_hub_dataset(r.dataset)
        common = dict(task_type="text-generation", task_name="Speculative decoding",
                      dataset_type=r.dataset if hub else "custom", dataset_name=r.dataset_label,
                      metric_type="acceptance_length",
                      metric_args={**r.sampling, **({"draft_method": r.draft_method} if r.draft_method else {})}
                      or None)
        for s in r.subsets:
            evals.append(EvalResult(**common, dataset_config=s.name, metric_value=round(s.acceptance_length, 4),
                                    metric_name=f"acceptance length ({r.short})"))
        if r.weighted is not None:
            evals.append(EvalResult(**common, metric_value=round(r.weighted, 4),
                                    metric_name=f"weighted mean acceptance length ({r.short})"))
    return ModelCardData(
        base_model=inputs.verifier_id, library_name="transformers", pipeline_tag="text-generation",
        license=inputs.license, tags=tags, datasets=_train_datasets(inputs.run_config) or None,
        model_name=inputs.repo_id.split("/")[-1] if evals else None, eval_results=evals or None,
    )


def render_card(inputs: CardInputs, run_config_sha: str | None = None) -> ModelCard:
    """The model card: `TEMPLATE_FILE` rendered from data by `huggingface_hub`'s `ModelCard.from_template`."""
    return ModelCard.from_template(
        card_metadata(inputs), template_path=TEMPLATE_FILE, title=inputs.repo_id.split("/")[-1],
        summary=summary_section(inputs), usage=usage_section(inputs), architecture=architecture_section(inputs),
        training=training_section(inputs), evaluation=evaluation_section(inputs),
        limitations=limitations_section(inputs), provenance=provenance_section(inputs, run_config_sha),
    )
