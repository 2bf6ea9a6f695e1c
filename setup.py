"""The product's top-level folders install as quantgate.<folder>; their packages and data files are found here, so
that a new subpackage or data file is in the wheel without being listed (pyproject.toml holds the rest)."""

from pathlib import Path

from setuptools import find_packages, setup

ROOTS = ("flows", "tasks", "catalog", "warehouse")
SKIPPED = {"__pycache__"}


def packages() -> dict[str, str]:
    """quantgate.<root>[.<sub>...] -> its folder, for every folder with an __init__.py."""
    found = {}
    for root in ROOTS:
        found[f"quantgate.{root}"] = root
        for sub in find_packages(root):
            found[f"quantgate.{root}.{sub}"] = f"{root}/{sub.replace('.', '/')}"
    return found


def package_data(folders: dict[str, str]) -> dict[str, list[str]]:
    """Every file that is not a package's own module, as data of the package whose folder holds it: YAML, SQL,
    and whole folders that are data to another library (lm-eval's task files, their Python included)."""
    owner = {Path(folder): name for name, folder in folders.items()}
    data: dict[str, list[str]] = {}
    for root in ROOTS:
        for path in sorted(Path(root).rglob("*")):
            if not path.is_file() or SKIPPED & set(path.parts) or path.suffix == ".pyc":
                continue
            if path.suffix == ".py" and path.parent in owner:
                continue
            folder = next(p for p in path.parents if p in owner)
            data.setdefault(owner[folder], []).append(path.relative_to(folder).as_posix())
    return data


FOLDERS = packages()
setup(packages=list(FOLDERS), package_dir=FOLDERS, package_data=package_data(FOLDERS))
