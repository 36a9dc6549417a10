"""The pure-PyTorch copy of natsl that a Hugging Face export carries, so that its remote code runs with
torch and transformers alone (natsl is not on the package index).

Design. `natsl convert CKPT OUT --to hf` writes, beside `modeling_natsl.py`, natsl's own model code as
flat files (`natsl.ops.cached` -> `natsl_ops_cached.py`), generated here from the installed natsl's
sources at export time, so there is one source of truth and the bundle is the code that exported it:

- the modules: every natsl module that `natsl.models.lm` (the model), `natsl.models.cache` (its cache)
  and `natsl.inference.decode` (the decode runner) import, directly, inside functions or by name
  (natsl.ops.TWINS' "module:function" strings) (BUNDLE_ROOTS);
  that is natsl.models, natsl.ops (the doors), natsl.reference (the pure-PyTorch and chunked ops),
  natsl.switches and natsl.errors;
- not bundled: natsl.fast (the Triton kernels). An import of it becomes `raise ImportError(...)` inside
  a function (what an absent module does: the fast paths that ask for it fail, `try` blocks that probe
  for it see it missing) and `name = None` at module level (re-exports only the fast paths read), and
  natsl.devices is replaced by a `natsl_devices.py` in which Triton is unavailable, so every door
  takes its PyTorch twin;
- natsl.config is replaced by `natsl_config.py`: `ModelConfig` as natsl defines it (without its
  validation, which ran when the export was written) and the values natsl.checkpoint gives model fields
  that older exports lack;
- imports are rewritten to relative ones (`from natsl.models.linear import Linear` ->
  `from .natsl_models_linear import Linear`, `from natsl import ops` -> `from . import natsl_ops as ops`),
  and the "module:function" names of natsl.ops.TWINS to the bundled modules;
- `natsl_bundle.py` is the bundle's index: what the remote code takes from it;
- the exported `modeling_natsl.py` is natsl.hf.modeling_natsl with one generated function appended,
  never called, that names every bundled file in a `from .X import` line: transformers copies a local
  remote-code folder's files by those lines, from the modeling file alone in transformers 4 (5 follows
  them from file to file).

The modeling file runs the installed natsl when it can read the export (its Triton kernels on CUDA),
else this bundle on natsl's chunked backend (modeling_natsl's doc). tests/test_hf_standalone.py loads
exports in a process that cannot import natsl and checks that the bundle imports nothing else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import natsl

PACKAGE_ROOT = Path(natsl.__file__).parent
MODELING_FILE = Path(__file__).with_name("modeling_natsl.py")
BUNDLE_ROOTS = ("natsl.models.lm", "natsl.models.cache", "natsl.inference.decode")
NOT_BUNDLED = "natsl.fast"  # the Triton kernels
CONFIG = "natsl.config"  # replaced by the generated natsl_config.py
DEVICES = "natsl.devices"
INDEX = "natsl_bundle"
# What the remote code takes from the bundle (modeling_natsl.bundled_runtime).
INDEX_EXPORTS = {"natsl.models.lm": ["CausalLM"], "natsl.inference.decode": ["DecodeRunner"],
                 CONFIG: ["ModelConfig", "OLDER_EXPORT_FIELDS", "model_fingerprint"]}
# natsl.checkpoint's values for the model fields older exports lack (complete_model_section).
OLDER_FIELD_TABLES = ("TRAINING_ONLY_MODEL_FIELDS", "MAMBA2_MODEL_FIELDS", "LATER_MODEL_FIELDS")
TWIN_NAME = re.compile(r"(natsl(?:\.\w+)+):(\w+)")
DEVICES_SOURCE = '''"""natsl.devices in the bundle of a Hugging Face export, which carries no Triton kernels
(natsl.fast): Triton is never available to it, so every door of natsl.ops takes the PyTorch twin."""


def triton_available() -> bool:
    return False


def triton_interpreted() -> bool:
    return False
'''


def flat_name(module: str) -> str:
    """A natsl module's file stem in the bundle: natsl.ops.cached -> natsl_ops_cached."""
    return module.replace(".", "_")


def source_file(module: str) -> Path | None:
    """The source of natsl module `module` (a package's __init__.py), None when there is none."""
    path = PACKAGE_ROOT.joinpath(*module.split(".")[1:])
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def is_module(module: str) -> bool:
    return source_file(module) is not None


def imported_modules(tree: ast.AST) -> set[str]:
    """The natsl modules a module imports anywhere (a `from pkg import sub` of a submodule names the
    submodule, not the package), or names as "module:function" (natsl.ops.TWINS, imported by name)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and TWIN_NAME.fullmatch(node.value):
            found.add(TWIN_NAME.fullmatch(node.value).group(1))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "natsl")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "natsl":
            names = [a.name for a in node.names]
            subs = [f"{node.module}.{n}" for n in names if is_module(f"{node.module}.{n}")]
            found.update(subs)
            if len(subs) < len(names):
                found.add(node.module)
    return found


def bundled_modules() -> list[str]:
    """Every natsl module in the bundle: the import closure of BUNDLE_ROOTS without natsl.fast, with
    natsl.config and natsl.devices (generated, not followed)."""
    seen, todo = set(), list(BUNDLE_ROOTS)
    while todo:
        module = todo.pop()
        if module in seen or module == NOT_BUNDLED or module.startswith(NOT_BUNDLED + "."):
            continue
        seen.add(module)
        if module not in (CONFIG, DEVICES):
            todo.extend(imported_modules(ast.parse(source_file(module).read_text(encoding="utf-8"))))
    return sorted(seen)


# ----------------------------------------------------------------------------- rewriting

def _fast(module: str) -> bool:
    return module == NOT_BUNDLED or module.startswith(NOT_BUNDLED + ".")


def _rewrite_import(node: ast.stmt, nested: bool, modules: set[str]) -> list[str] | None:
    """The lines that replace a natsl import statement in the bundle (None: not a natsl import)."""
    if isinstance(node, ast.Import):
        if not any(a.name.split(".")[0] == "natsl" for a in node.names):
            return None
        lines = []
        for a in node.names:
            if _fast(a.name):
                lines.append(f"raise ImportError({a.name + ' (Triton kernels) is not bundled'!r})" if nested
                             else f"{(a.asname or a.name).split('.')[0]} = None  # {a.name}: not bundled")
            elif a.name in modules:
                lines.append(f"from . import {flat_name(a.name)}" + (f" as {a.asname}" if a.asname else "") +
                             "  # noqa: F401")
            else:
                raise ValueError(f"cannot bundle `import {a.name}`")
        return lines
    if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "natsl"):
        return None
    module = node.module
    if _fast(module):
        bound = [a.asname or a.name for a in node.names]
        if nested:
            return [f"raise ImportError({module + ' (Triton kernels) is not bundled'!r})"]
        return [" = ".join(bound) + f" = None  # {module}: not bundled (Triton kernels)"]
    subs, names = [], []
    for a in node.names:
        full = f"{module}.{a.name}"
        if full in modules:
            subs.append(f"from . import {flat_name(full)} as {a.asname or a.name}")
        elif _fast(full):
            subs.append(f"{a.asname or a.name} = None  # {full}: not bundled (Triton kernels)")
        else:
            names.append(a.name + (f" as {a.asname}" if a.asname else ""))
    if names:
        if module not in modules:
            raise ValueError(f"cannot bundle `from {module} import {', '.join(names)}`")
        subs.append(f"from .{flat_name(module)} import {', '.join(names)}")
    return subs


def rewrite_source(source: str, modules: set[str]) -> str:
    """A natsl module's source as a bundle module: natsl imports relative (see the module doc), TWINS'
    "module:function" names pointing at the bundled modules."""
    tree = ast.parse(source)
    lines = source.splitlines()
    edits = []  # (first line, last line, replacement lines), 1-based, inclusive

    def visit(node, nested: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                new = _rewrite_import(child, nested, modules)
                if new is not None:
                    indent = " " * child.col_offset
                    edits.append((child.lineno, child.end_lineno, [indent + line for line in new]))
                    continue
            visit(child, nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    visit(tree, False)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.lineno == node.end_lineno:
            match = TWIN_NAME.fullmatch(node.value)
            if match and match.group(1) in modules:
                new = f'".{flat_name(match.group(1))}:{match.group(2)}"'
                edits.append((node.lineno, node.lineno, (node.col_offset, node.end_col_offset, new)))
    # Later edits first, so that earlier line numbers stay valid; string edits within a line right to left.
    for first, last, new in sorted(edits, key=lambda e: (e[0], e[2][0] if isinstance(e[2], tuple) else -1),
                                   reverse=True):
        if isinstance(new, tuple):
            start, end, text = new
            raw = lines[first - 1].encode("utf-8")
            lines[first - 1] = (raw[:start] + text.encode("utf-8") + raw[end:]).decode("utf-8")
        else:
            lines[first - 1:last] = new
    return "\n".join(lines) + "\n"


def config_source() -> str:
    """natsl_config.py: ModelConfig without its validation, natsl.checkpoint's values for the model
    fields older exports lack (OLDER_EXPORT_FIELDS) and its model_fingerprint (the check of an edit)."""
    text = source_file(CONFIG).read_text(encoding="utf-8")
    tree = ast.parse(text)
    lines = text.splitlines()
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelConfig")
    start = min([cls.lineno] + [d.lineno for d in cls.decorator_list])
    drop = set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name.startswith("validate"):
            drop.update(range(item.lineno - 1 - len(item.decorator_list), item.end_lineno))
    body = [line for i, line in enumerate(lines[start - 1:cls.end_lineno], start - 1) if i not in drop]
    checkpoint = source_file("natsl.checkpoint").read_text(encoding="utf-8")
    tables = [ast.get_source_segment(checkpoint, n) for n in ast.parse(checkpoint).body
              if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) in OLDER_FIELD_TABLES
              or isinstance(n, ast.FunctionDef) and n.name == "model_fingerprint"]
    head = ['"""natsl.config.ModelConfig as the exporting natsl defines it, without its validation (which ran',
            'when the export was written); the values natsl.checkpoint gives the model fields that older',
            'exports lack (OLDER_EXPORT_FIELDS), and its model_fingerprint."""', "", "from __future__ import annotations", "",
            "import hashlib", "import json", "from dataclasses import dataclass, field",
            "from typing import Literal, Optional", "",
            # the class reads its block_size default from natsl.block_size (bundled: natsl.ops imports it)
            f"from .{flat_name('natsl.block_size')} import DEFAULT_BLOCK_SIZE", "", ""]
    tail = ["", "", *[t + ("\n\n" if t.startswith("def ") else "") for t in tables], "OLDER_EXPORT_FIELDS = {" + ", ".join(f"**{t}" for t in OLDER_FIELD_TABLES) + "}"]
    return "\n".join(head + body + tail) + "\n"


def index_source() -> str:
    lines = ['"""The index of the natsl code bundled with this export (natsl.hf.bundle): what modeling_natsl.py',
             'takes from it."""', ""]
    for module, names in INDEX_EXPORTS.items():
        lines.append(f"from .{flat_name(module)} import {', '.join(names)}  # noqa: F401")
    return "\n".join(lines) + "\n"


def modeling_source(stems: list[str]) -> str:
    """The export's modeling_natsl.py: natsl.hf.modeling_natsl and a function naming the bundle's files
    (`stems`) for transformers' copy (see the module doc)."""
    lines = ["", "", "# -- written at export (natsl.hf.bundle) " + "-" * 60,
             "def _bundled_files():",
             '    """Never called: transformers copies the files of a local remote-code folder that the modeling',
             '    file names in `from .X import` lines (transformers 4 reads this file only), here every file of',
             '    the natsl code bundled with this export."""']
    lines += [f"    from .{stem} import __name__  # noqa: F401" for stem in stems]
    return MODELING_FILE.read_text(encoding="utf-8") + "\n".join(lines) + "\n"


def bundle_sources() -> dict[str, str]:
    """File name -> text of every file of the bundle (natsl_bundle.py and one per bundled module)."""
    from natsl import __version__

    modules = bundled_modules()
    names = set(modules)
    files = {}
    for module in modules:
        if module in (CONFIG, DEVICES):
            text = config_source() if module == CONFIG else DEVICES_SOURCE
        else:
            text = rewrite_source(source_file(module).read_text(encoding="utf-8"), names)
        where = "generated" if module in (CONFIG, DEVICES) else f"natsl/{source_file(module).relative_to(PACKAGE_ROOT)}"
        files[f"{flat_name(module)}.py"] = (f"# natsl {__version__}, {where}, bundled with a Hugging Face export "
                                            "(natsl.hf.bundle)\n" + text)
    files[f"{INDEX}.py"] = index_source()
    return files


def export_sources() -> dict[str, str]:
    """File name -> text of every remote-code file of an export: modeling_natsl.py and the bundle."""
    files = bundle_sources()
    files[MODELING_FILE.name] = modeling_source(sorted(name[:-3] for name in files))
    return files


def write_remote_code(folder: Path) -> list[str]:
    """Write modeling_natsl.py and the bundle into an export folder; returns the file names."""
    files = export_sources()
    for name, text in files.items():
        (Path(folder) / name).write_text(text, encoding="utf-8")
    return sorted(files)
