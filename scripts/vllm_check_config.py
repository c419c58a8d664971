"""How vLLM reads a DSpark drafter: builds vLLM's engine config for `--speculative-config {"method": "dspark",
"model": DRAFTER}` on VERIFIER and prints, as JSON, the speculative method, the number of speculative tokens and
the draft config vLLM parsed (the fields its DSpark model reads). Nothing is loaded or run.

    <vLLM python> scripts/vllm_check_config.py DRAFTER VERIFIER [--num-speculative-tokens K]

Run it with the python of an environment that has vLLM (`make vllm-env` creates .venv-vllm). vLLM serves DSpark
only on its V2 model runner, which needs Triton; on a CPU-only vLLM the runner check is bypassed here, in this
process only, so the config can be validated where it cannot be served (tests/vllm/test_vllm_serving.py compares the
result with the drafter's config.json).
"""

import json
import os
import sys

# The vLLM environment does not install this package: its root goes on the path for the shared error path, last,
# so that nothing here shadows what vLLM imports.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.errors import Parser, UsageError, run_cli  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter")
    parser.add_argument("verifier")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="default: the drafter's speculators_config proposal")
    args = parser.parse_args(argv)
    from configuration_dspark import is_hub_id

    for what, name in (("drafter", args.drafter), ("verifier", args.verifier)):
        if not os.path.exists(name) and not is_hub_id(name):
            raise UsageError(f"{what} {name} is neither an existing directory nor a Hub id; check the path.")
    try:
        import vllm.config.vllm as vllm_config
        from vllm.engine.arg_utils import EngineArgs
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise
        raise UsageError(f"vLLM is not installed in {sys.executable}; run this script with the vLLM environment's "
                         f"python (`make vllm-env` creates .venv-vllm).") from e

    vllm_config.HAS_TRITON = True  # validation only (see the docstring)
    speculative = {"method": "dspark", "model": args.drafter}
    if args.num_speculative_tokens:
        speculative["num_speculative_tokens"] = args.num_speculative_tokens
    engine = EngineArgs(model=args.verifier, speculative_config=speculative, max_model_len=512, enforce_eager=True,
                        dtype="float32").create_engine_config()
    spec = engine.speculative_config
    draft = spec.draft_model_config.hf_config.to_dict()
    print(json.dumps({"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                      "parallel_drafting": getattr(spec, "parallel_drafting", None),
                      "draft_config": {k: v for k, v in draft.items() if not isinstance(v, dict)}}, default=str))


if __name__ == "__main__":
    sys.exit(run_cli(main))
