"""Every code block of the README and the guides (``docs/``) that is not python is checked (the python ones:
``tests/distributed/test_readme.py``), without launching a process or training:

- ``bash``: every command line that runs our code (``lightning-2d …``, ``python -m lightning_2d …``, ``srun`` and
  ``torchrun`` of them, ``python recipes/X.py …``) parses with the real parser: ``fit``/``validate``/``test``/
  ``predict`` with ``Lightning2DCLI``'s (jsonargparse: the ``--config`` files loaded, types and dotted overrides
  checked), the tools with their ``build_parser()`` (and the recipe part of their options with ``fit``'s, as they
  read it), a recipe script with its own argparse. Other programs (pip, mkdocs, pytest, ``python -c``, git, torch's
  tools) are skipped by rule: they are not ours. Placeholders of the docs (``...``, ``$NODE_RANK``, ``RECIPE.yaml``)
  are replaced by the values of ``PLACEHOLDERS``, never skipped. Every repository path a command names exists.
- ``yaml``: an excerpt of a recipe (first line ``# excerpt of recipes/X.yaml``, every line found in the file), or a
  fragment merged over ``FRAGMENT_BASE`` and parsed by ``fit``'s parser, its dict-valued settings built as the
  dataclass they stand for (a misspelt key of ``lora:`` fails).
- ``jinja``: renders in our sandbox (``ChatTemplate``, transformers' rules) to what the template of the same text in
  the library renders, with the same ``{% generation %}`` spans.
- ``text``: generated parts (``<!-- generated: … -->``: ``tests/unit/test_docs.py``) are skipped; ``$ lightning-2d
  plan …`` outputs are what the planner prints now; error messages are made of the library's own strings;
  sample outputs of runs too long to repeat here are listed in ``SAMPLES`` with the words of the prose that
  presents them. A text block in none of these classes fails.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
import shlex
import sys
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, Optional

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
#: The Markdown a person reads: the README (the site's home page) and every guide.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

#: What the docs write in place of a value the reader supplies, and what the test parses instead (shell variables
#: before the line is split, whole words after).
PLACEHOLDERS = {
    "$NODE_RANK": "0",
    "$MASTER_ADDR": "127.0.0.1",
    "RECIPE.yaml": "recipes/debug_cpu.yaml",
    "...": "/placeholder",  # --data.paths=... --data.tokenizer=...: any path parses
}
#: Where a path of the repository starts: such an argument must name an existing file or folder.
REPO_PATHS = ("recipes/", "tests/", "docs/", "lightning_2d/", ".ci/")
#: The recipe a ``yaml`` fragment is merged over (any recipe: the fragment's keys are what is checked).
FRAGMENT_BASE = "recipes/debug_cpu.yaml"
#: ``LightningCLI``'s subcommands; the others are ``lightning_2d.tools.cli.TOOLS``.
FIT_COMMANDS = ("fit", "validate", "test", "predict")

#: Sample outputs of runs this module cannot repeat (minutes of training, a corpus built first), by the start of
#: their first line: the words of the prose just before the block that say what printed them, and why not rerun.
SAMPLES = {
    "Epoch 0:   1%": ("What the main job shows", "the main job's progress bar: 2.5 minutes of training on 4 processes"),
    "  rows           2,952": ("`prepare-data` on `recipes/sft_cpu.yaml`",
                               "encodes the built-in chat corpus (~3,000 conversations) first"),
    "---- /root/.cache/lightning_2d/stdlib-chats-v1.jsonl": ("`--preview 1`",
                                                             "renders the built-in chat corpus, built first"),
    "---- ~/.cache/lightning_2d/stdlib-preferences-v1.jsonl": (
        "`lightning-2d prepare-data --config recipes/dpo_cpu.yaml --preview 1`",
                                                               "renders the built-in preference corpus, built first"),
    # The getting-started chain, each step from the previous one's export (tests/distributed/test_recipe_scripts.py
    # runs it with fewer steps).
    "$ lightning-2d fit --config recipes/debug_cpu.yaml": ("`recipes/debug_cpu.yaml`", "the chain's pretraining"),
    "$ python -c 'from transformers import pipeline": ("continues code", "samples the pretrained export"),
    "$ lightning-2d fit --config recipes/sft_cpu.yaml": ("`recipes/sft_cpu.yaml`", "fine-tunes the pretrained export"),
    "$ lightning-2d fit --config recipes/lora_cpu.yaml": ("`recipes/lora_cpu.yaml`", "adapts the pretrained export"),
    "$ lightning-2d fit --config recipes/dpo_cpu.yaml": ("`recipes/dpo_cpu.yaml`", "preference-tunes the SFT export"),
    "$ for model in hf_sft hf_lora hf_dpo": ("`pipeline()`", "asks the chain's fine-tuned exports"),
}


# ---- the blocks -----------------------------------------------------------------------------------
class Block(NamedTuple):
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str  # dedented to the fence
    generated: bool  # inside <!-- generated: … --> … <!-- end generated -->
    before: str  # the prose paragraph just above the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


@lru_cache(maxsize=None)
def blocks() -> tuple[Block, ...]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        generated = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("<!-- generated:"):
                generated = True
            elif line.startswith("<!-- end generated"):
                generated = False
            fence = re.match(r"^( *)```(\w+)\s*$", line)
            if not fence:
                i += 1
                continue
            indent, lang = len(fence.group(1)), fence.group(2)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            text = "\n".join(body[indent:] for body in lines[i + 1:end])
            start = i
            while start > 0 and not lines[start - 1].strip():
                start -= 1
            top = start
            while top > 0 and lines[top - 1].strip() and not lines[top - 1].lstrip().startswith("```"):
                top -= 1
            found.append(Block(page, i + 1, lang, text, generated, " ".join(lines[top:start])))
            i = end + 1
    return tuple(found)


def of(lang: str) -> list[Block]:
    return [b for b in blocks() if b.lang == lang]


def test_every_block_has_a_known_language():
    kinds = {b.lang for b in blocks()}
    assert kinds <= {"bash", "text", "python", "yaml", "jinja"}, f"a new kind of block: check it here ({kinds})"


# ---- bash: the commands ---------------------------------------------------------------------------
class Command(NamedTuple):
    where: str
    text: str  # the logical line as written (continuations joined)
    argv: tuple[str, ...]  # after the placeholders were replaced


def _substitute(line: str) -> str:
    for name, value in PLACEHOLDERS.items():
        if name.startswith("$") or name.endswith(".yaml"):
            line = line.replace(name, value)
    return line


def _placeholder_word(word: str) -> str:
    name, eq, value = word.partition("=")
    if eq and value in PLACEHOLDERS:
        return f"{name}={PLACEHOLDERS[value]}"
    return PLACEHOLDERS.get(word, word)


@lru_cache(maxsize=None)
def commands() -> tuple[Command, ...]:
    """Each command of every bash block: ``\\`` continuations joined, comments and ``#SBATCH`` lines dropped,
    ``&&``/``||``/``;``/``|`` chains split."""
    found = []
    for block in of("bash"):
        logical: list[str] = []
        for line in block.text.splitlines():
            if logical and logical[-1].endswith("\\"):
                logical[-1] = logical[-1][:-1].rstrip() + " " + line.strip()
            else:
                logical.append(line.strip())
        for line in logical:
            if not line or line.startswith("#"):
                continue
            words = shlex.split(_substitute(line), comments=True)
            chain: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", ";", "|"):
                    if chain:
                        found.append(Command(block.where, line, tuple(_placeholder_word(w) for w in chain)))
                    chain = []
                else:
                    chain.append(word)
    return tuple(found)


class Ours(NamedTuple):
    kind: str  # "cli": lightning-2d's argv; "script": a python file's; "module": python -m lightning_2d.X;
    # "refused": a launcher's own options do not parse (target: why)
    target: str
    args: tuple[str, ...]


def ours(argv: tuple[str, ...]) -> Optional[Ours]:
    """What of ours a command runs, or ``None`` for another program's command (pip, mkdocs, pytest, python -c …)."""
    words = list(argv)
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before the program
        words.pop(0)
    if words and words[0] == "srun":
        words.pop(0)
        while words and words[0].startswith("-"):
            words.pop(0)
    if not words:
        return None
    program, args = Path(words[0]).name, words[1:]
    if program == "lightning-2d":
        return Ours("cli", "lightning-2d", tuple(args))
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                run = get_args_parser().parse_args(args)  # torchrun's own options parse too
            except SystemExit:
                return Ours("refused", f"torchrun: {err.getvalue()[-500:]}", tuple(args))
        words = ["python", *(["-m"] if run.module else []), run.training_script, *run.training_script_args]
        program, args = "python", words[1:]
    if re.fullmatch(r"python[\d.]*", program):
        if len(args) >= 2 and args[0] == "-m" and args[1].split(".")[0] == "lightning_2d":
            if args[1] == "lightning_2d":
                return Ours("cli", "lightning-2d", tuple(args[2:]))
            return Ours("module", args[1], tuple(args[2:]))
        if args and args[0].endswith(".py"):
            return Ours("script", args[0], tuple(args[1:]))
    return None


class _Parsed(Exception):
    """Raised by the patched ``ArgumentParser.parse_args`` once a script's own parser accepted its options."""


@lru_cache(maxsize=None)
def fit_parser() -> Any:
    """``lightning-2d fit``'s parser (with ``validate``, ``test``, ``predict``), as ``cli_main`` builds it: nothing is
    parsed or instantiated (``parse_arguments`` is where ``LightningCLI.__init__`` would first use it)."""
    from lightning_2d.tools.cli import DESCRIPTION, MODEL_AND_DATA, Lightning2DCLI

    class Built(Exception):
        pass

    class ParserOnly(Lightning2DCLI):
        def parse_arguments(self, parser: Any, args: Any) -> None:
            raise Built(parser)

    with pytest.raises(Built) as built:
        ParserOnly(**MODEL_AND_DATA, args=[], run=True, save_config_kwargs={"overwrite": True},
                   parser_kwargs={"description": DESCRIPTION})
    return built.value.args[0]


def parse_fit(argv: list[str], what: str) -> Any:
    """``lightning-2d fit ARGV`` parsed (files loaded, types and overrides checked), or the test fails with
    jsonargparse's message. A line with ``--print_config`` is parsed without it first: it prints and exits 0 when
    the rest parses, but a line that does not leaves the parser set to print on the next parse."""
    parser = fit_parser()
    printing = any(o.split("=")[0] == "--print_config" for o in argv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            config = parser.parse_args([o for o in argv if o.split("=")[0] != "--print_config"])
            if printing:
                with pytest.raises(SystemExit) as printed:
                    parser.parse_args(argv)
                assert printed.value.code == 0, f"{what}: --print_config exits with {printed.value.code}"
            return config
        except SystemExit:
            pytest.fail(f"{what}: `lightning-2d {argv[0]}` refuses it:\n{err.getvalue()[-1500:]}")


def parse_argparse(parser: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    """``parser`` parses ``argv``, each option spelt in full (argparse would take ``--accumulat`` for
    ``--accumulate``: a renamed option would go unnoticed)."""
    parser.allow_abbrev = False
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{what}: {parser.prog} refuses it:\n{err.getvalue()[-1500:]}")


def check_cli(args: tuple[str, ...], what: str) -> None:
    from lightning_2d.tools.cli import COMMANDS, TOOLS
    from lightning_2d.tools.recipe import normalized_args, split_argv

    assert args, f"{what}: a command is missing after lightning-2d"
    command, *options = args
    if command in ("-h", "--help", "-V", "--version"):
        return
    assert command in COMMANDS, f"{what}: lightning-2d has no command {command!r} (it has {', '.join(COMMANDS)})"
    if command in FIT_COMMANDS:
        parse_fit([command, *options], what)
        return
    module = importlib.import_module(TOOLS[command])
    parser = module.build_parser()
    own_flags = getattr(importlib.import_module(module.build_parser.__module__), "OWN_FLAGS", ())
    reads_recipe = "--config" in parser.format_help()  # plan, benchmark, prepare-data: split_argv, as their main
    own, recipe = split_argv(options, own=own_flags) if reads_recipe else (options, [])
    parse_argparse(parser, own, what)
    if recipe:
        from lightning_2d.tools.recipe import RecipeError

        try:
            recipe = normalized_args(recipe)  # every --config a file
        except RecipeError as err:
            pytest.fail(f"{what}: {err}")
        parse_fit(["fit", *recipe], what)  # fit_config: the recipe read by fit's parser


@lru_cache(maxsize=None)
def _script(path: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"docs_script_{Path(path).stem}", REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_script(main: Any, argv: list[str], what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``main()`` run until its own argparse parser has parsed ``argv`` (``sys.argv`` for a script), then stopped."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        self.allow_abbrev = False  # each option spelt in full, as parse_argparse
        raise _Parsed(parse_args(self, args, namespace))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", [what, *argv])
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                main()
            except _Parsed:
                return
            except SystemExit:
                pytest.fail(f"{what}: its parser refuses it:\n{err.getvalue()[-1500:]}")
    pytest.fail(f"{what}: main() returned without parsing options")


def repo_paths(argv: tuple[str, ...]) -> list[str]:
    paths = []
    for word in argv:
        value = word.partition("=")[2] if word.startswith("-") else word
        if value.startswith(REPO_PATHS):
            paths.append(value.split("::")[0])  # a pytest node id: its file
    return paths


def test_the_commands_are_found():
    """The counts this module is about (a block that stops being read is noticed)."""
    mine = [c for c in commands() if ours(c.argv)]
    assert len(of("bash")) >= 15 and len(mine) >= 30, (len(of("bash")), len(mine))
    kinds = {ours(c.argv).kind for c in mine}
    assert {"cli", "script"} <= kinds


@pytest.mark.parametrize("command", commands(), ids=lambda c: f"{c.where}:{c.argv[0]}")
def test_every_command_of_ours_parses(command: Command, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)
    what = f"{command.where}: {command.text}"
    for path in repo_paths(command.argv):
        assert (REPO / path).exists(), f"{what}: {path} does not exist"
    run = ours(command.argv)
    if run is None:
        return  # another program's command (pip, mkdocs, pytest, git, python -c …): not ours to parse
    assert run.kind != "refused", f"{what}: {run.target}"
    if run.kind == "cli":
        check_cli(run.args, what)
    elif run.kind == "script":
        assert (REPO / run.target).is_file(), f"{what}: {run.target} does not exist"
        check_script(_script(run.target).main, list(run.args), what, monkeypatch)
    else:  # python -m lightning_2d.X: a tool as `lightning-2d NAME`, another module (docs, plots) by its main
        from lightning_2d.tools.cli import TOOLS

        tool = {module: name for name, module in TOOLS.items()}.get(run.target.removesuffix(".__main__"))
        if tool:
            check_cli((tool, *run.args), what)
        else:
            check_script(lambda: importlib.import_module(run.target).main(list(run.args)), [], what, monkeypatch)


# ---- yaml -----------------------------------------------------------------------------------------
EXCERPT = re.compile(r"# excerpt of (\S+)\n")


def _dataclasses_of(annotation: Any) -> list[type]:
    return [a for a in typing.get_args(annotation) or (annotation,) if dataclasses.is_dataclass(a)]


@pytest.mark.parametrize("block", of("yaml"), ids=lambda b: b.where)
def test_yaml_blocks_are_excerpts_or_parse(block: Block, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)
    excerpt = EXCERPT.match(block.text + "\n")
    if excerpt:
        source = (REPO / excerpt.group(1)).read_text().splitlines()
        for line in block.text.splitlines()[1:]:
            assert line in source or not line.strip(), f"{block.where}: not in {excerpt.group(1)}: {line!r}"
        return
    fragment = yaml.safe_load(block.text)
    assert isinstance(fragment, dict), f"{block.where}: neither an excerpt (# excerpt of FILE) nor a recipe fragment"
    config = parse_fit(["fit", f"--config={FRAGMENT_BASE}", f"--config={block.text}"], block.where)
    # A dict typed "SomeDataclass | dict" is taken whole by jsonargparse: build it as the module does.
    model = config.fit.model
    module_name, _, class_name = model.class_path.rpartition(".")
    module_class = getattr(importlib.import_module(module_name), class_name)
    hints = typing.get_type_hints(module_class.__init__)
    for key in (fragment.get("model") or {}).get("init_args") or {}:
        value = getattr(model.init_args, key)
        for cls in _dataclasses_of(hints.get(key)):
            if isinstance(value, dict):
                try:
                    cls(**value)
                except TypeError as err:
                    pytest.fail(f"{block.where}: model.init_args.{key} is not a {cls.__name__}: {err}")
    # "key: value   # or ALTERNATIVE": the alternative parses too.
    for line in block.text.splitlines():
        alternative = re.match(r"^(\s*)(\w+): .*#\s*or (\{.*\})\s*$", line)
        if alternative:
            swapped = block.text.replace(line, f"{alternative.group(1)}{alternative.group(2)}: {alternative.group(3)}")
            parse_fit(["fit", f"--config={FRAGMENT_BASE}", f"--config={swapped}"], f"{block.where} ({line.strip()})")


# ---- jinja ----------------------------------------------------------------------------------------
#: A conversation each template is rendered on: a system turn, two user/assistant exchanges.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6"},
]


@lru_cache(maxsize=None)
def library_sources() -> tuple[tuple[Path, ast.Module], ...]:
    """Every module of ``lightning_2d``, parsed (read once for the templates, classes and strings below)."""
    return tuple((path, ast.parse(path.read_text())) for path in sorted((REPO / "lightning_2d").rglob("*.py")))


@lru_cache(maxsize=None)
def library_templates() -> dict[str, str]:
    """Every module-level string constant of ``lightning_2d`` and every template file of the repository's fixtures
    that holds a Jinja statement, by name."""
    found = {}
    for path in sorted((REPO / "tests" / "fixtures" / "chat_templates").glob("*.jinja")):
        found[str(path.relative_to(REPO))] = path.read_text()
    for path, tree in library_sources():
        for node in tree.body:
            value = node.value if isinstance(node, ast.Assign) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and "{% for" in value.value:
                found[f"{path.relative_to(REPO)}:{node.targets[0].id}"] = value.value
    return found


def renders(source: str) -> Any:
    from lightning_2d.data.chat.template import ChatTemplate, ChatTemplateError

    try:
        template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
        return template.render(CONVERSATION, add_generation_prompt=True)
    except ChatTemplateError:  # a template for other conversations (tools, no system turn)
        return None


@pytest.mark.parametrize("block", of("jinja"), ids=lambda b: b.where)
def test_jinja_blocks_are_library_templates(block: Block):
    from lightning_2d.data.chat.template import ChatTemplate

    # As a file holds it: one line, "\n" inside the string literals (Jinja's escapes).
    shown = ChatTemplate(block.text.strip(), origin=block.where)
    rendered = shown.render(CONVERSATION, add_generation_prompt=True)
    # The same text (as a Python string holds it: "\n" a newline), else the same rendering.
    as_written = block.text.strip().replace("\\n", "\n")
    same = [name for name, source in library_templates().items() if source == as_written]
    same = same or [name for name, source in library_templates().items() if renders(source) == rendered]
    assert all(renders(library_templates()[name]) == rendered for name in same), block.where
    assert same, f"{block.where}: renders unlike every template of the library and the fixtures"
    if shown.has_generation_tags:  # the spans are the assistant's text and its end of turn, nothing else
        assert [rendered.text[a:b] for a, b in rendered.generation] == ["4<|im_end|>", "6<|im_end|>"], block.where


# ---- text -----------------------------------------------------------------------------------------
PLAN = re.compile(r"^\$ lightning-2d plan (?!.*--help)(.*)$")
#: ``module.Class: message`` or ``Class: message`` (the first line of an error block).
ERROR = re.compile(r"^(?:([\w.]+)\.)?(\w+(?:Error|Exception)): ")
#: A log line of ours: ``[lightning_2d watchdog, rank 0] …``.
LOG = re.compile(r"^\[lightning_2d (\w+), rank \d+\] ")


def text_class(block: Block) -> str:
    first = block.text.splitlines()[0]
    if block.generated:
        return "generated"
    if PLAN.match(first):
        return "plan"
    if ERROR.match(first) or LOG.match(first):
        return "message"
    if any(first.startswith(start) for start in SAMPLES):
        return "sample"
    return "unknown"


def test_every_text_block_is_classified():
    classes = {b.where: text_class(b) for b in of("text")}
    assert "unknown" not in classes.values(), [w for w, c in classes.items() if c == "unknown"]
    assert {"generated", "plan", "message", "sample"} <= set(classes.values())


@pytest.mark.parametrize("block", [b for b in of("text") if text_class(b) == "sample"], ids=lambda b: b.where)
def test_sample_outputs_say_what_printed_them(block: Block):
    label, _why = next(v for k, v in SAMPLES.items() if block.text.startswith(k))
    assert label in block.before, f"{block.where}: the prose before this sample output should say {label!r}"
    for path in repo_paths(tuple(label.strip("`").split())):
        assert (REPO / path).exists(), f"{block.where}: {path} does not exist"


#: Planner outputs a test of ``tests/unit/test_planner.py`` already compares with the planner: page → that test.
PLANNED_THERE = {"docs/scaling/pipeline.md": "test_the_docs_pipeline_view_is_what_the_planner_prints"}


def test_the_planner_outputs_checked_elsewhere_are():
    source = (REPO / "tests" / "unit" / "test_planner.py").read_text()
    for page, test in PLANNED_THERE.items():
        body = source.partition(f"def {test}(")[2].partition("\ndef ")[0]
        assert Path(page).name in body and "$ lightning-2d plan" in body, f"{test} no longer checks {page}'s output"
    planned = {str(b.page.relative_to(REPO)) for b in of("text") if text_class(b) == "plan"}
    assert set(PLANNED_THERE) <= planned


@pytest.mark.parametrize("block", [b for b in of("text") if text_class(b) == "plan"
                                   and str(b.page.relative_to(REPO)) not in PLANNED_THERE], ids=lambda b: b.where)
def test_planner_outputs_are_what_it_prints(block: Block, capsys: pytest.CaptureFixture):
    """``$ lightning-2d plan …`` and what follows: the command run now prints the same (but its timing line)."""
    from lightning_2d.tools import planner

    command, *shown = block.text.splitlines()
    capsys.readouterr()
    planner.main(shlex.split(PLAN.match(command).group(1)))
    printed = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("(planned in")]
    assert printed == shown, f"{block.where}: `{command[2:]}` prints otherwise now"


@lru_cache(maxsize=None)
def library_classes() -> dict[str, tuple[str, ...]]:
    """Each class of ``lightning_2d``: the modules that define it."""
    found: dict[str, tuple[str, ...]] = {}
    for path, tree in library_sources():
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (*found.get(node.name, ()), module)
    return found


@lru_cache(maxsize=None)
def library_strings() -> tuple[str, ...]:
    """The literal pieces of every string of ``lightning_2d`` (an f-string's text between its ``{}`` fields; implicit
    concatenation joined), each line apart, at least 8 characters."""
    pieces: set[str] = set()
    for _, tree in library_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts = [node.value]
            else:
                continue
            for part in parts:
                pieces.update(p.strip() for p in part.split("\n") if len(p.strip()) >= 8)
    return tuple(sorted(pieces, key=len, reverse=True))


def uncovered(line: str) -> list[str]:
    """The parts of ``line`` that no string of the library writes (what its ``{}`` fields filled in). Where the
    docs cut a message short (``…``), the text before the cut may end with the beginning of a string of the
    library."""
    covered = [False] * len(line)

    def cover(start: int, length: int) -> None:
        covered[start:start + length] = [True] * length

    cuts = [m.start() for m in re.finditer("…", line)]
    for piece in library_strings():
        start = line.find(piece)
        while start >= 0:
            cover(start, len(piece))
            start = line.find(piece, start + 1)
        for cut in cuts:  # the piece's beginning, up to the cut
            start = line.rfind(piece[:8], 0, cut)
            while start >= 0:
                if piece.startswith(line[start:cut].rstrip()):
                    cover(start, cut - start)
                start = line.rfind(piece[:8], 0, start)
    for cut in cuts:
        cover(cut, 1)
    return [m.group(0) for m in re.finditer(r"[^\x00]+", "".join("\x00" if c else ch for c, ch in zip(covered, line)))]


#: What a ``{}`` field of a message fills in: numbers, lists, names, paths, ``…`` (the rest of a long message left
#: out) — not two or more words of prose.
FIELD = re.compile(r"^(?!.*\b[a-z]{2,} [a-z]{2,}\b).*$", re.S)


@pytest.mark.parametrize("block", [b for b in of("text") if text_class(b) == "message"], ids=lambda b: b.where)
def test_error_messages_are_the_library_s(block: Block):
    """Each line of an error (or log) block is the library's strings with their fields filled in: a reworded
    message fails."""
    lines = block.text.splitlines()
    error = ERROR.match(lines[0])
    if error:  # the class is the library's: where the block says, else anywhere in lightning_2d
        names = library_classes().get(error.group(2), ())
        assert names, f"{block.where}: lightning_2d defines no {error.group(2)}"
        assert not error.group(1) or error.group(1) in names, f"{block.where}: {error.group(2)} is in {names}"
    first = lines[0][error.end():] if error else lines[0][LOG.match(lines[0]).end():]
    for line in [first, *lines[1:]]:
        text = line.strip().removeprefix("- ")
        if not text:
            continue
        rest = [part for part in uncovered(text) if not FIELD.match(part)]
        assert not rest, f"{block.where}: not the library's words: {rest} in {line!r}"
        assert sum(map(len, uncovered(text))) <= len(text) / 2, f"{block.where}: mostly not the library's: {line!r}"
