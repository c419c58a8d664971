"""The model card's usage section: how to serve the drafter with vLLM (the options its calibration and
training suit, and the draft method its results measured more with) and how to decode with it in process through
transformers' `custom_generate`."""

from __future__ import annotations

from trainer.evaluation.results import AcceptanceResults
from trainer.export.card_sections import _BACKENDS, CardInputs, read_calibration

_TRAINED_FOR = {
    "greedy": "vLLM's default greedy drafting (`draft_sample_method: greedy`, the verifier sampling at its own "
              "temperature)",
    "greedy_t0": "greedy drafting with greedy (temperature 0) verification",
    "sampled": "probabilistic drafting (`draft_sample_method: probabilistic`)",
}


def serving_options(inputs: CardInputs) -> str:
    """Which vLLM options the drafter was trained for, from its config, run config and calibration record."""
    c = inputs.config
    block = c["block_size"]
    rows = [f"- Keep `num_speculative_tokens` at {block} (what `config.json` gives vLLM): training drafted blocks of "
            f"exactly {block} slots, and the full-attention layers attend across the whole block, so another count "
            f"drafts out of distribution."]
    cal = read_calibration(inputs.checkpoint.path)
    target = ((inputs.run_config or {}).get("train") or {}).get("confidence_target") or (cal or {}).get(
        "confidence_target")
    if c.get("enable_confidence_head", True):
        if target in _TRAINED_FOR:
            rows.append(f"- The confidence head was trained for {_TRAINED_FOR[target]}; with another drafting mode its "
                        f"confidences are biased.")
        if cal:
            rows.append(f"- `enable_adaptive_verification: true` (in `--speculative-config`) verifies only the draft "
                        f"slots with the highest cumulative confidence; the head was calibrated on held-out data "
                        f"(expected calibration error {cal['ece_before']:.3f} -> {cal['ece_after']:.3f}), so its "
                        f"ranking can be trusted. Off by default.")
        else:
            rows.append("- `enable_adaptive_verification` relies on the confidence head, which was not calibrated for "
                        "this export: measure before turning it on.")
    family = str((c.get("verifier_text_config") or {}).get("model_type") or "")
    if family.startswith("gemma4"):
        rows.append("- Keep `kv_sharing_fast_prefill` off (the default): Gemma 4's fast-prefill path produces no "
                    "verifier hidden states for the drafter to read.")
    return "#### Serving options this drafter was trained for\n\n" + "\n".join(rows)


_SERVED_METHODS = ("greedy", "probabilistic")  # vLLM's `draft_sample_method` values


def _mean(r: AcceptanceResults, weighted: bool) -> float:
    return r.weighted if weighted else r.unweighted


def _setting(r: AcceptanceResults) -> str:
    """Where a T > 0 measurement was taken, in words: "T = 1, top_p 0.95 (in-process, prompts `heldout`, up to 64 new
    tokens)"."""
    extra = [f"{k} {r.sampling[k]}" for k in ("top_p", "top_k", "min_p") if r.sampling.get(k) is not None]
    how = [_BACKENDS.get(r.backend, r.backend)] if r.backend else []
    how.append(f"prompts `{r.dataset_label}`")
    if r.max_new_tokens:
        how.append(f"up to {r.max_new_tokens} new tokens")
    return ", ".join([f"T = {r.sampling['temperature']:g}", *extra]) + f" ({', '.join(how)})"


def draft_method_section(results: list[AcceptanceResults]) -> str | None:
    """Which of vLLM's draft methods measured more where the verifier samples, and what to set for it.

    Only measurements that differ in the draft method alone are compared: same sampling settings, backend, prompts
    and token budget (the first file of each method in a group counts). A group that measured one method says only
    that; greedy decoding (T = 0) has nothing to choose, every method takes the argmax there. None when no result
    at T > 0 records its draft method."""
    groups: dict[tuple, dict[str, AcceptanceResults]] = {}
    for r in results:
        if not r.sampling or r.greedy or r.draft_method is None:
            continue
        key = (tuple(sorted((k, v) for k, v in r.sampling.items() if v is not None)), r.backend, r.dataset,
               r.max_new_tokens)
        groups.setdefault(key, {}).setdefault(r.draft_method, r)
    if not groups:
        return None
    lines = []
    for methods in groups.values():
        where = _setting(next(iter(methods.values())))
        if all(m in methods for m in _SERVED_METHODS):
            greedy, probabilistic = methods["greedy"], methods["probabilistic"]
            weighted = greedy.weighted is not None and probabilistic.weighted is not None
            label = "weighted acceptance length" if weighted else "unweighted mean acceptance length"
            g, p = f"{_mean(greedy, weighted):.3f}", f"{_mean(probabilistic, weighted):.3f}"
            default_is_fine = ("so vLLM's default greedy drafting is fine when serving at T > 0 (no "
                               "`draft_sample_method` to set).")
            if float(p) > float(g):
                lines.append(f"At {where}, probabilistic drafts measured the higher {label}: {p} against {g} with "
                             f"greedy drafts (vLLM's default). When serving at T > 0, consider "
                             f"`\"draft_sample_method\": \"probabilistic\"` in vLLM's speculative config "
                             f"(`--speculative-config`).")
            elif float(g) > float(p):
                lines.append(f"At {where}, greedy drafts (vLLM's default) measured the higher {label}: {g} against "
                             f"{p} with probabilistic drafts, {default_is_fine}")
            else:
                lines.append(f"At {where}, greedy and probabilistic drafts measured the same {label} ({g}), "
                             f"{default_is_fine}")
        else:
            measured = [f"{_mean(r, r.weighted is not None):.3f}"
                        + ("" if len(methods) == 1 else f" with {m} drafts") for m, r in methods.items()]
            label = "weighted acceptance length" if all(r.weighted is not None for r in methods.values()) else \
                "acceptance length"
            lines.append(f"At {where}, only {' and '.join(methods)} drafts were measured ({label} "
                         f"{', '.join(measured)}).")
    return ("#### Which draft method to serve with\n\nvLLM drafts greedily unless its speculative config sets "
            "`draft_sample_method`; when the verifier samples (T > 0) the draft method changes how many drafts are "
            "accepted, never the output's distribution.\n\n" + "\n\n".join(lines))


def usage_section(inputs: CardInputs) -> str:
    repo, v, block = inputs.repo_id, inputs.verifier_id, inputs.config["block_size"]
    revision = inputs.revision or "main"
    methods = draft_method_section(inputs.results)
    methods = f"\n\n{methods}" if methods else ""
    return f"""### vLLM

vLLM (0.31 or newer) reads the verifier (`{v}`) and the number of speculative tokens ({block}) from `config.json`, so
neither is passed separately:

```bash
vllm serve {repo} --port 8000
```

Then query the OpenAI-compatible endpoint at `http://localhost:8000/v1`; the model id is the drafter repo as typed:

```python
from openai import OpenAI

client = OpenAI(base_url="http://localhost:8000/v1", api_key="EMPTY")
reply = client.chat.completions.create(model="{repo}", messages=[{{"role": "user", "content": "Hello!"}}],
                                       max_tokens=256)
print(reply.choices[0].message.content)
```

{serving_options(inputs)}{methods}

### transformers

`trust_remote_code=True` runs this repo's `configuration_dspark.py` and `modeling_dspark.py` (the drafter) and
`custom_generate/generate.py` (the decoding loop), so pin the commit you reviewed (its hash from the "Files and
versions" tab) rather than a moving branch:

```python
import torch
from transformers import AutoModel, AutoTokenizer

REVISION = "{revision}"  # replace with the reviewed commit hash
device = "cuda" if torch.cuda.is_available() else "cpu"
drafter = AutoModel.from_pretrained("{repo}", trust_remote_code=True, revision=REVISION,
                                    dtype=torch.bfloat16).to(device)
verifier = drafter.load_verifier(dtype=torch.bfloat16, device_map=device)  # {v}; shares its embeddings
tokenizer = AutoTokenizer.from_pretrained("{v}")
```

The drafter alone is not a language model: using it before `load_verifier()` / `attach_verifier(model)` raises.

### In-process speculative generation

The speculative decoding loop ships in this repo as `custom_generate/generate.py`, transformers' convention for a
decoding loop that lives with a model: the verifier's own `generate` runs it when given this repo, with nothing
installed beyond `torch` and `transformers`:

```python
messages = [{{"role": "user", "content": "Explain speculative decoding in one paragraph."}}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"].to(device)
out = verifier.generate(input_ids, custom_generate="{repo}", trust_remote_code=True, revision=REVISION,
                        drafter=drafter, max_new_tokens=256,  # sampling: the verifier's generation config
                        return_dict_in_generate=True)
print(tokenizer.decode(out.sequences[0, input_ids.shape[1]:], skip_special_tokens=True))
print("acceptance length", sum(out.committed_per_step) / len(out.committed_per_step))
```

The output is exactly the verifier's (token-identical to its plain `generate` when it decodes greedily, identically
distributed when it samples), and `committed_per_step` holds the tokens committed per verification step; without
`return_dict_in_generate` it returns the sequences alone. The settings are `generate`'s (`max_new_tokens`,
`do_sample`, `temperature`, `top_k`, `top_p`, `eos_token_id`, defaulting to the verifier's generation config), for
one sequence at a time. It drafts as `vllm serve` does by default, greedily (`draft_method="greedy"`);
`draft_method="probabilistic"` samples the drafts at the temperature only, as vLLM's `draft_sample_method:
probabilistic`. Either changes how many drafts are accepted, never the output's distribution."""
