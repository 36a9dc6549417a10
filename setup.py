"""What pyproject.toml cannot say: ship the top-level recipes/ inside the wheel as natsl/recipes/, and
install `natsl-lm-eval.pth` into site-packages (see _natsl_lm_eval.py).

The recipes live once in git, at the checkout's top level (`natsl train recipes/800m_hybrid.yaml` works as
written there); a wheel gets a copy as package data so that `natsl train tiny_hybrid` finds them when installed
(natsl.config.recipes_root). An editable install reads the checkout's folder directly.

A wheel gets the file beside the packages (build_py copies it into build_lib); an editable install
(PEP 660) builds its wheel from a finder and a .pth of its own, so the file is added to that wheel
after it is written. Its name sorts after setuptools' `__editable__.*.pth`, which must run first to
make `_natsl_lm_eval` importable from the checkout.
"""

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "natsl-lm-eval.pth"
RECIPES = Path("recipes")


def recipe_files() -> list[Path]:
    """The shipped recipes, relative to the checkout: recipes/*.yaml and one folder level below."""
    return sorted([*RECIPES.glob("*.yaml"), *RECIPES.glob("*/*.yaml")])


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(PTH, str(Path(self.build_lib) / PTH), preserve_mode=False)
            for recipe in recipe_files():
                target = Path(self.build_lib) / "natsl" / recipe
                self.mkpath(str(target.parent))
                self.copy_file(str(recipe), str(target), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        copies = [str(Path(self.build_lib) / "natsl" / recipe) for recipe in recipe_files()]
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH), *copies]


class EditableWheelWithPth(editable_wheel):
    def run(self):
        super().run()
        for wheel in Path(self.dist_dir).glob("*.editable-*.whl"):
            add_to_wheel(wheel, PTH)


def add_to_wheel(wheel: Path, name: str) -> None:
    """Rewrite `wheel` with the file `name` at its root, listed in RECORD (so pip uninstall removes it)."""
    data = Path(name).read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel) as old:
        if name in old.namelist():
            return
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as old, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as new:
        for item in old.infolist():
            content = old.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                content += f"{name},sha256={digest},{len(data)}\n".encode()
            new.writestr(item, content)
        new.writestr(name, data)
    tmp.replace(wheel)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
