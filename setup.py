"""The build step that pyproject.toml cannot declare: the top-level ``selectors/``, ``studies/``
and ``prompts/`` folders are copied into the built package as ``statelab/_data/`` (found by
:func:`statelab.resources.data_dir`).  An editable install reads them in place."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
DATA = ("selectors", "studies", "prompts")


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for name in DATA:
            dest = Path(self.build_lib) / "statelab" / "_data" / name
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(HERE / name, dest, ignore=shutil.ignore_patterns("__pycache__", ".*"))


setup(cmdclass={"build_py": BuildPyWithData})
