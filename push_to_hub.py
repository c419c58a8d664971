"""Export a DSpark checkpoint as a servable Hugging Face Hub repo with a model card, then upload it.

    python push_to_hub.py --checkpoint out/checkpoint-best --repo-id me/gemma-4-E4B-it-dspark
    python push_to_hub.py --checkpoint out/run:latest --repo-id me/x --eval-results t1.json greedy.json
    python push_to_hub.py --checkpoint out/run --repo-id me/x --dry-run exported/       # no network at all

The export runs in three steps, and any failure stops it before anything reaches the Hub:

1. **Stage** a folder that is exactly the serving contract (the tensor list in `trainer/contract.py`): bf16
   `model.safetensors` with only the contract's tensors and nothing of the verifier, `config.json` naming
   the verifier by Hub id (vLLM 0.33 refuses local paths there), the two remote-code files, the decoding loop
   as `custom_generate/generate.py` (for `verifier.generate(..., custom_generate=<repo>)`), `README.md` (the
   model card, rendered from the checkpoint's config, its saved run configuration and the given evaluation
   results, never from typed numbers) and, with results, the per-position acceptance plot.
2. **Validate** the staged folder: the structural checks vLLM applies to a speculators config, the exact
   tensor set with its dtypes, finite weights equal to the checkpoint's (bf16-rounded), and a load through
   `AutoModel.from_pretrained(..., trust_remote_code=True)` (and of `custom_generate/generate.py` through
   transformers' loader) in a fresh process with an empty module cache,
   which is what a user of the pushed repo runs.
3. **Upload** the folder in one commit with `huggingface_hub` (`create_repo(exist_ok=True)`, optional
   branch, one `upload_folder`), after refusing to overwrite a repo that holds a drafter for a different
   verifier unless `--force`. The staged folder lives in the system temp directory and is always removed,
   so a failed upload leaves nothing behind locally; the Hub commit itself is atomic.

`--checkpoint` accepts a `checkpoint-N` directory (it must carry the trainer's completion marker, which a
save writes last, so an interrupted save is refused), the run's final model, or a training output_dir, which
means its `checkpoint-best` when present, else its own final model, else its latest complete checkpoint.
`OUTPUT_DIR:best`, `OUTPUT_DIR:latest`, `OUTPUT_DIR:final` and `OUTPUT_DIR:<step>` select explicitly.
Symlinks are resolved. (The run directory's layout is described in `trainer/train/checkpoints.py`.)

`--eval-results` takes the `dspark-acceptance/1` JSON files that `trainer/evaluation/in_process.py` writes (format in
`trainer/evaluation/results.py`); each must be measured for this drafter's block size, verifier and weights: on
the checkpoint itself, or on a `--dry-run` export of it (served by vLLM, say), whose bf16 weights hash differently
but record the checkpoint's sha256 in their safetensors metadata, which the results carry.

The token comes from the usual Hugging Face sources (`HF_TOKEN`, or the login saved by `hf auth login`) and
is never printed. Errors are one sentence naming the cause and the fix; the exit status is 2 for bad input
(a flag, a path, a results file, offline mode, no token) and 1 for a failure at run time (disk, network).
`--debug` shows the traceback too.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import huggingface_hub
from huggingface_hub import get_token
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import validate_repo_id

from trainer.contract import read_json
from trainer.errors import DSparkError, Parser, UsageError, run_cli
from trainer.evaluation.results import SCHEMA as RESULTS_SCHEMA
from trainer.export.staging import DELETE_PATTERNS, Staged, StagingError, is_export_file, stage
from trainer.files import replace_durably
from trainer.train.checkpoints import BEST_LINK, Checkpoint, resolve_checkpoint

PushError = DSparkError  # every refusal or failure of an export (checkpoint, results, serving, upload) is one


# ================================================================================================
# Upload
# ================================================================================================
def _remote_verifier(api, repo_id: str, revision: str | None) -> str | None:
    """The verifier named by the repo's current config.json, or None for a new/empty repo or branch."""
    for rev in dict.fromkeys([revision, None]):
        try:
            path = api.hf_hub_download(repo_id=repo_id, filename="config.json", revision=rev, repo_type="model")
        except RevisionNotFoundError:
            continue  # a new branch: compare with the default branch instead
        except (RepositoryNotFoundError, EntryNotFoundError):
            return None
        config = read_json(Path(path))
        return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "(none)"
    return None


def upload(api, repo_id: str, staged: Staged, *, private: bool = False, revision: str | None = None,
           create_pr: bool = False, commit_message: str | None = None, force: bool = False) -> str:
    """Push the staged folder as exactly one commit and return its URL (the PR URL with `create_pr`).

    `api` is an `HfApi` (or anything with the same methods: tests inject a fake). The calls, in order:
    `hf_hub_download(config.json)` to refuse a repo that serves another verifier, `create_repo(exist_ok=True)`,
    `create_branch(exist_ok=True)` for a `revision` other than main, then one `upload_folder`."""
    existing = _remote_verifier(api, repo_id, revision)
    if existing is not None and existing != staged.verifier_id and not force:
        raise UsageError(f"{repo_id} already holds a drafter for verifier {existing}, not {staged.verifier_id}; push to "
                         f"another repo, or pass --force to replace it.")
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    if revision and revision != "main":
        api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=repo_id, folder_path=str(staged.folder), repo_type="model", revision=revision, create_pr=create_pr,
        commit_message=commit_message or staged.commit_message, commit_description=staged.commit_description,
        delete_patterns=DELETE_PATTERNS,
    )
    url = getattr(info, "pr_url", None) if create_pr else None
    return url or getattr(info, "commit_url", None) or str(info)


# ================================================================================================
# Command line
# ================================================================================================
def build_parser() -> Parser:
    p = Parser(
        prog="push_to_hub.py", description="Export a DSpark checkpoint as a servable Hub repo with a model card.",
        epilog=f"--checkpoint: a checkpoint-N dir, the run's output_dir ({BEST_LINK}, else its final model, else "
               f"the latest complete checkpoint) or OUTPUT_DIR:best|latest|final|<step>.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory or training output_dir[:selector]")
    p.add_argument("--repo-id", required=True, help="target Hub repo, ORG/NAME")
    p.add_argument("--verifier-id", help="the verifier's Hub id for config.json (default: the checkpoint's)")
    p.add_argument("--eval-results", nargs="+", action="extend", default=[], metavar="FILE",
                   help=f"{RESULTS_SCHEMA} JSON files measured on this checkpoint or on its --dry-run export "
                        f"(one card section each)")
    p.add_argument("--license", default="apache-2.0", help="license metadata for the card (default: apache-2.0)")
    p.add_argument("--private", action="store_true", help="create the repo as private (when it does not exist)")
    p.add_argument("--revision", help="branch to commit to (created when missing; default: main)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")
    p.add_argument("--commit-message", help="override the data-derived commit message")
    p.add_argument("--force", action="store_true", help="replace a repo that holds a drafter for another verifier")
    p.add_argument("--dry-run", metavar="OUT_DIR", help="stage and validate into OUT_DIR only; no network at all")
    p.add_argument("--debug", action="store_true", help="show the traceback of an expected failure too")
    return p


def _check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UsageError(f"--repo-id {repo_id!r} is not a valid Hub repo id ({e}); use ORG/NAME.") from e
    if "/" not in repo_id:
        raise UsageError(f"--repo-id {repo_id!r} has no namespace; use ORG/NAME (your user name or an organization).")


def _staged_export(path: Path) -> bool:
    """A directory holding only files an export writes (safe to replace on a repeated --dry-run)."""
    return all(p.is_file() and is_export_file(p.relative_to(path).as_posix())
               for p in path.rglob("*") if not p.is_dir())


def _print_plan(staged: Staged, args, out=None) -> None:
    out = out or sys.stdout  # looked up per call, so redirected output (tests, wrappers) is honoured
    width = max(map(len, staged.files))
    print(f"staged {len(staged.files)} files from {staged.checkpoint.path}:", file=out)
    for name, size in staged.files.items():
        print(f"  {name:<{width}}  {size:>12,} bytes", file=out)
    where = f"revision {args.revision or 'main'}" + (", as a pull request" if args.create_pr else "")
    print(f"commit to {args.repo_id} ({where}):", file=out)
    print(f"  message: {args.commit_message or staged.commit_message}", file=out)
    for line in staged.commit_description.splitlines():
        print(f"  | {line}", file=out)


def _stage(checkpoint: Checkpoint, folder: Path, args, where, fix: str) -> Staged:
    """`stage` with the command's options; a disk error while writing into `where` is reported with `fix`."""
    try:
        return stage(checkpoint, folder, repo_id=args.repo_id, verifier_id=args.verifier_id,
                     eval_results=args.eval_results, license=args.license, revision=args.revision)
    except OSError as e:
        raise StagingError(f"staging into {where} failed ({e}); {fix}.") from e


def _dry_run(checkpoint: Checkpoint, args) -> Staged:
    out = Path(args.dry_run).resolve()
    if out.exists() and not (out.is_dir() and _staged_export(out)):
        raise UsageError(f"--dry-run directory {out} exists and holds other files; pass a new directory or remove it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    # A dry run killed mid-way leaves its staging folder (or the previous export it was replacing) beside OUT_DIR.
    for leftover in sorted([*out.parent.glob(f"{out.name}.tmp-*"), *out.parent.glob(f"{out.name}.old-*")]):
        print(f"removing {leftover.name}, left by an interrupted dry run")
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        staged = _stage(checkpoint, tmp, args, tmp,
                        "free disk space there or choose another --dry-run directory, then rerun")
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
            replace_durably(out, old / "x")
        replace_durably(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    staged.folder = out
    return staged


def _export(argv: list[str], api, token: str | None) -> None:
    args = build_parser().parse_args(argv)
    _check_repo_id(args.repo_id)
    if not args.dry_run:
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            raise UsageError("Hugging Face Hub offline mode is on (HF_HUB_OFFLINE=1); unset it to upload or use "
                             "--dry-run OUT_DIR.")
        if not token:
            raise UsageError("no Hugging Face token found; run `hf auth login` or set HF_TOKEN.")
    checkpoint = resolve_checkpoint(args.checkpoint)
    print(f"exporting {checkpoint.path}" + (f" (step {checkpoint.step})" if checkpoint.step is not None else ""))
    if args.dry_run:
        staged = _dry_run(checkpoint, args)
        _print_plan(staged, args)
        print(f"dry run: validated {staged.folder}; nothing was uploaded.")
        return
    with tempfile.TemporaryDirectory(prefix="dspark-push-") as tmp:
        staged = _stage(checkpoint, Path(tmp) / "repo", args, tmp,
                        "free disk space there (or point TMPDIR at a larger disk) and rerun")
        _print_plan(staged, args)
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(token=token)
        try:
            url = upload(api, args.repo_id, staged, private=args.private, revision=args.revision,
                         create_pr=args.create_pr, commit_message=args.commit_message, force=args.force)
        except DSparkError:
            raise
        except Exception as e:  # network, auth, permissions: the Hub commit is atomic, so nothing half-pushed
            rerun = shlex.join(["python", "push_to_hub.py", *argv])
            raise DSparkError(f"upload to {args.repo_id} failed ({type(e).__name__}: {e}); nothing was committed "
                              f"and the staged folder was removed, so fix the cause and rerun: {rerun}") from e
    print(f"uploaded {len(staged.files)} files to {args.repo_id} in one commit: {url}")


def main(argv: list[str] | None = None, api=None) -> int:
    """CLI entry; returns the exit status. `api` injects an `HfApi`-like object (tests); by default a real
    `HfApi` is built after the offline and token checks, and never in --dry-run."""
    token = get_token()
    return run_cli(lambda a: _export(a, api, token), argv, redact=(token or "",))


if __name__ == "__main__":
    sys.exit(main())
