"""Every command block in the README and docs/ is checked against the code, so a renamed flag, command, module,
config, script, Makefile target or extra fails the suite instead of a newcomer's first try.

A block is a fenced `bash` block. Its lines are joined at backslash continuations, comments dropped, and split
into commands at `&&`, `||`, `;`, `|` and `&`. Each command is checked by what it runs:

    make TARGET [VAR=value]               the target exists in the Makefile, each VAR is one it reads
    python -m trainer CMD ...             CMD is a command of the table; every --flag is one its parser declares
    python -m benchmarks.X / push_to_hub.py / scripts/X.py
                                          the module or script exists; every --flag is one its parser declares
    [accelerate launch ...] trainer/run.py --config C --key value
                                          C exists; the overrides parse as run-config keys (RunConfig.load)
    python -m trainer vllm-server ... # prints the command below
                                          the printed command equals the documented one, token for token
    pip install -e ".[extra]"             each extra is declared in setup.cfg
    vllm serve, curl, hf, source, ...     tools of other projects: only the repository paths they name are checked

A program the table does not know fails the test, so a new kind of command is checked rather than skipped.
Fenced `python` blocks must parse, and every name they import from this package must exist.

The flags are read from each command's own argparse parser, in process (the command is stopped as it starts to
parse), so the whole check takes seconds.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import contextlib
import importlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Programs of other projects a doc may run: only the repository paths they name are checked.
EXTERNAL = {"vllm", "curl", "hf", "source", "cd", "export", "until", "do", "done", "sleep", "nvidia-smi", "ready",
            "git", "ls", "cat", "mkdir", "rm", "cp", "kill", "wait"}
PYTHONS = {"python", "python3", ".venv/bin/python"}
# Leading words that start a shell construct rather than a command.
SHELL_WORDS = {"until", "do", "done", "then", "fi", "while"}


# ------------------------------------------------------------------------------------------------ extraction
def fenced_blocks(path: Path, languages: tuple[str, ...]) -> list[tuple[int, str]]:
    """`(first line number, text)` of every fenced block in `path` whose language is one of `languages`."""
    blocks, inside, start, lines = [], False, 0, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = line.strip()
        if not inside and fence.startswith("```") and fence[3:] in languages:
            inside, start, lines = True, number + 1, []
        elif inside and fence == "```":
            blocks.append((start, "\n".join(lines)))
            inside = False
        elif inside:
            lines.append(line)
    return blocks


def bash_blocks(path: Path) -> list[tuple[int, str]]:
    return fenced_blocks(path, ("bash", "sh", "shell"))


def python_blocks(path: Path) -> list[tuple[int, str]]:
    return fenced_blocks(path, ("python",))


def split_comment(line: str) -> tuple[str, str]:
    """`(code, comment)`: a `#` starts a comment at a word start outside quotes, as in the shell."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:].strip()
    return line, ""


def commands(block: str) -> list[tuple[list[str], str]]:
    """The commands of a block as `(tokens, trailing comment)`; a shell function definition is skipped (its body
    is a command of its own only when called)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        code, comment = split_comment(line.strip())
        if not code.strip() or re.match(r"^[\w-]+\(\)\s*\{", code.strip()):
            continue
        lexer = shlex.shlex(code, posix=True, punctuation_chars="&|;")
        lexer.whitespace_split = True
        lexer.commenters = ""
        try:
            tokens = list(lexer)
        except ValueError as e:  # an unbalanced quote is a broken command
            raise AssertionError(f"cannot parse the shell line {line!r}: {e}") from e
        current: list[str] = []
        for token in tokens:
            if set(token) <= set("&|;"):
                if current:
                    out.append((current, comment))
                current = []
            else:
                current.append(token)
        if current:
            out.append((current, comment))
    return out


def all_commands() -> list[tuple[str, list[str], str, str]]:
    """`(where, tokens, comment, block)` for every command of every doc."""
    found = []
    for path in DOC_FILES:
        for line, block in bash_blocks(path):
            for tokens, comment in commands(block):
                found.append((f"{path.relative_to(ROOT)}:{line}", tokens, comment, block))
    return found


# ------------------------------------------------------------------------------------------------ the code's side
class _Parsed(BaseException):
    """Raised from inside argparse to stop a command right after its parser is built (BaseException: the
    commands' error path catches Exception)."""


_OPTIONS: dict[tuple[str, str], set[str]] = {}


def parser_options(target: tuple[str, str]) -> set[str]:
    """The option strings a command's argparse parser declares, read from the parser itself (not from its help
    text, whose prose may mention a flag that no longer exists). `target` is `("trainer", CMD)`, `("module",
    NAME)` or `("script", PATH)`; the command runs in process until it parses its arguments."""
    if target in _OPTIONS:
        return _OPTIONS[target]
    found: list[set[str]] = []

    def capture(parser, args=None, namespace=None):
        found.append(set(parser._option_string_actions))
        raise _Parsed

    kind, name = target
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), \
            mock.patch.object(sys, "argv", [name]):
        try:
            if kind == "trainer":
                from trainer.__main__ import COMMANDS

                command = COMMANDS[name]
                getattr(importlib.import_module(command.module), command.function)([])
            elif kind == "module":
                importlib.import_module(name).main([])
            else:  # a script, as `python SCRIPT` runs it
                runpy.run_path(str(ROOT / name), run_name="__main__")
        except _Parsed:
            pass
    assert found, f"{target} never parsed its arguments with argparse"
    _OPTIONS[target] = found[0]
    return found[0]


def flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and len(t) > 2]


def unknown_flags(tokens: list[str], options: set[str]) -> list[str]:
    """Flags of `tokens` that the parser does not declare (either spelling: the parsers accept both)."""
    listed = {f.replace("_", "-") for f in options}
    return [f for f in flags(tokens) if f.replace("_", "-") not in listed and f != "--help"]


def makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", text, flags=re.M))
    variables = set(re.findall(r"\$\((\w+)\)", text)) | set(re.findall(r"^(\w+)\s*\??=", text, flags=re.M))
    return targets, variables


def extras() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return set(parser["options.extras_require"])


REPO_PATH = re.compile(r"^(configs|scripts|data/demo|trainer|benchmarks|tests|docs)/[\w./-]*$")


def missing_repo_paths(tokens: list[str]) -> list[str]:
    """Tokens naming a file of this repository (configs/, scripts/, ...) that does not exist."""
    return [t for t in tokens if REPO_PATH.match(t) and not (ROOT / t).exists()]


# ------------------------------------------------------------------------------------------------ checks
def check_run_py(tokens: list[str]) -> None:
    """`trainer/run.py --config C --key value ...`: C exists and the overrides are run-config keys of the right
    types (the same parsing a run does before anything is loaded)."""
    from trainer.config import RunConfig

    rest = tokens[tokens.index("trainer/run.py") + 1:]
    config = None
    if "--config" in rest:
        i = rest.index("--config")
        config, rest = rest[i + 1], rest[:i] + rest[i + 2:]
        assert (ROOT / config).is_file(), f"config {config} does not exist"
    RunConfig.load(str(ROOT / config) if config else None, rest)


LLAMA_SERVER = ".llamacpp/build/bin/llama-server"  # where make llamacpp-env builds it


def llama_server_flags() -> set[str]:
    """Every flag this package starts llama-server with (the evaluator's servers and export-gguf's printed
    command): a documented llama-server command may use only these, so a flag llama.cpp renames is caught where
    the code is tested against the real server (make test-llamacpp)."""
    from trainer.export.gguf import serve_command
    from trainer.serving.llamacpp import LlamaCpp, LlamaServer

    build = LlamaCpp(ROOT / ".llamacpp")
    argv = LlamaServer(build, "v.gguf", "d.gguf", block_size=4, p_min=0.5, kv_type="f32", threads=2,
                       port=1).argv() + shlex.split(serve_command(build, Path("v"), Path("d"), 4))
    return {token for token in argv if token.startswith("-")}


def check(tokens: list[str]) -> None:
    """One command; an AssertionError (or the code's own UsageError) says what is wrong."""
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value prefixes
        tokens = tokens[1:]
    assert tokens, "an empty command"
    program = tokens[0]
    assert not missing_repo_paths(tokens), f"names files that do not exist: {missing_repo_paths(tokens)}"
    if program in SHELL_WORDS or program in EXTERNAL:
        return
    if program == LLAMA_SERVER:
        used = llama_server_flags()
        unknown = [t for t in tokens[1:] if t.startswith("-") and t not in used]
        assert not unknown, f"llama-server flags {unknown} are not ones this package starts it with"
        return
    if program == "make":
        targets, variables = makefile()
        for token in tokens[1:]:
            if "=" in token:
                name = token.split("=", 1)[0]
                assert name in variables, f"the Makefile reads no variable {name}"
            else:
                assert token in targets, f"the Makefile has no target {token}"
        return
    if program == "accelerate":
        if tokens[1:] == ["config"]:  # accelerate's own interactive set-up
            return
        assert tokens[1] == "launch", "accelerate is only used as `accelerate config` and `accelerate launch`"
        scripts = [t for t in tokens if t.endswith(".py")]
        assert scripts == ["trainer/run.py"], f"accelerate launch runs trainer/run.py, not {scripts}"
        check_run_py(tokens)
        return
    if program in ("pip",):
        wanted = [e for t in tokens for group in re.findall(r"\.\[([\w,-]+)\]", t) for e in group.split(",")]
        unknown = sorted(set(wanted) - extras())
        assert not unknown, f"setup.cfg declares no extra {unknown}"
        for i, token in enumerate(tokens):
            if token == "-c":
                assert (ROOT / tokens[i + 1]).is_file(), f"constraints file {tokens[i + 1]} does not exist"
        return
    if program in PYTHONS:
        args = tokens[1:]
        if args[:2] == ["-m", "venv"]:
            return
        if args[:2] == ["-m", "trainer"]:
            from trainer.__main__ import COMMANDS

            assert len(args) > 2, "python -m trainer needs a command"
            name = args[2].replace("_", "-")
            assert name in COMMANDS, f"python -m trainer has no command {args[2]} ({', '.join(COMMANDS)})"
            if name == "train":
                check_run_py(["trainer/run.py", *args[3:]])
                return
            bad = unknown_flags(args[3:], parser_options(("trainer", name)))
            assert not bad, f"python -m trainer {name} has no flag {bad}"
            return
        if args[0] == "-m":
            module = args[1]
            assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"no module {module} in the repository"
            bad = unknown_flags(args[2:], parser_options(("module", module)))
            assert not bad, f"python -m {module} has no flag {bad}"
            return
        script = args[0]
        assert (ROOT / script).is_file(), f"no script {script} in the repository"
        if script == "trainer/run.py":
            check_run_py(args)
            return
        bad = unknown_flags(args[1:], parser_options(("script", script)))
        assert not bad, f"{script} has no flag {bad}"
        return
    raise AssertionError(f"the docs run {program!r}, which this test does not know how to check; teach it "
                         f"(tests/unit/test_docs.py) rather than skipping the command")


COMMANDS = all_commands()


def test_the_docs_have_commands_to_check():
    """The extraction itself: a README without command blocks, or a parser that finds none, fails here."""
    where = {w.split(":")[0] for w, *_ in COMMANDS}
    assert "README.md" in where and len(COMMANDS) >= 20, (len(COMMANDS), where)
    readme = {tuple(t[:2]) for w, t, *_ in COMMANDS if w.startswith("README.md")}
    assert ("make", "demo") in readme and ("make", "test") in readme, readme


@pytest.mark.parametrize("where,tokens", [(w, t) for w, t, *_ in COMMANDS], ids=lambda x: x if isinstance(x, str) else None)
def test_documented_command_matches_the_code(where, tokens):
    check(list(tokens))


PRINTING = [(f"{path.relative_to(ROOT)}:{line}", cmds[i][0], cmds[i + 1][0])
            for path in DOC_FILES for line, block in bash_blocks(path)
            for cmds in [commands(block)] for i in range(len(cmds) - 1) if "prints the command below" in cmds[i][1]]


def test_printed_commands_are_shown_as_printed():
    """A block that says a command "prints the command below" shows exactly what it prints: the vLLM extraction
    server's command (both served names, the layer ids, the connector) is copied from the docs, so it must be the
    one the code gives."""
    assert PRINTING, "the docs show no printed command any more; drop this test or restore the example"
    for where, printer, shown in PRINTING:
        args = printer[1:]
        assert args[:2] == ["-m", "trainer"], f"{where}: only `python -m trainer` commands are run here"
        from trainer.__main__ import COMMANDS

        command = COMMANDS[args[2]]
        function = getattr(importlib.import_module(command.module), command.function)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            function(args[3:])
        printed = shlex.split(buffer.getvalue())
        assert printed == shown, f"{where}: the docs show\n{shlex.join(shown)}\nbut the command prints\n{shlex.join(printed)}"


@pytest.mark.parametrize("path,line,source", [(str(p.relative_to(ROOT)), n, s) for p in DOC_FILES
                                              for n, s in python_blocks(p)])
def test_documented_python_imports_exist(path, line, source):
    tree = ast.parse(source, filename=f"{path}:{line}")
    own = ("configuration_dspark", "modeling_dspark", "generation_dspark", "trainer", "push_to_hub")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in own:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{path}:{line}: {node.module} has no {alias.name}"


def test_every_doc_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"
            assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


# ------------------------------------------------------------------------------------------------ the checker itself
@pytest.mark.parametrize("bad,why", [
    ("python -m trainer evaluate --drafter x --max-new-tokenz 4 --out y", "has no flag"),
    ("python -m trainer evaluat --drafter x", "has no command"),
    ("python push_to_hub.py --checkpoint x --repo-idd me/x", "has no flag"),
    ("python trainer/run.py --config configs/smollm2-135m.yaml --max_stepz 5", "unknown option"),
    ("python trainer/run.py --config configs/nope.yaml", "not exist"),
    ("make tests", "no target"),
    ("make test MARKS='not slow'", "no variable"),
    ('pip install -e ".[gpux]"', "no extra"),
    ("python -m benchmarks.nope --quick", "no module"),
    ("frobnicate --all", "does not know"),
])
def test_the_checker_catches_a_renamed_flag_or_module(bad, why):
    """The checker must fail on each kind of drift it claims to catch (else it is a test that cannot fail)."""
    (tokens, _), = commands(bad)
    with pytest.raises(Exception, match=why):
        check(tokens)


def test_every_relative_link_resolves():
    """A moved page or file breaks its links: each relative Markdown link must name an existing file."""
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+://", target) or target.startswith("#"):
                continue
            file, _, anchor = target.partition("#")
            linked = path.parent / file if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                broken.append(f"{path.relative_to(ROOT)} -> {target} (no such heading)")
    assert not broken, broken


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as dashes."""
    anchors = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors
