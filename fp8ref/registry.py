"""The packaged declarative files: the only reader of ``specs/``.

``specs/`` sits at the repository root and installs as the package data ``fp8ref/specs`` (setup.py
maps the one onto the other); ``SPECS_DIR`` is found with importlib.resources, and in a source
checkout (or an editable install of one), whose package folder has no ``specs/``, it is the
repository's own. Presets (``presets.yaml``), producer recipes (``recipes/*.yaml``) and golden
suites (``suites/*.yaml``) are found and loaded here, strictly
(``fp8ref.io.yaml``); the records they become are built by the modules that own them
(``recipes.recipe_from_document``, ``scheme.PRESETS``, ``golden.suite.parse_suite``).
"""

from __future__ import annotations

import functools
import threading
from importlib import resources
from pathlib import Path

from .errors import RecipeError, did_you_mean
from .io.paths import path_arg
from .io.yaml import YamlDocument, load_yaml
from .recipes import BlockRecipe, Recipe, block_recipe_from_document, recipe_from_document


def _specs_dir() -> Path:
    """fp8ref/specs as installed (a wheel, an sdist), else the top-level specs/ of the source tree the
    package runs from (beside its pyproject.toml); if neither is there, the installed path, so the
    first read names what is missing."""
    packaged = Path(str(resources.files(__package__).joinpath("specs")))  # never zipped: it has a C extension
    tree = Path(__file__).resolve().parent.parent
    if packaged.is_dir() or not (tree / "pyproject.toml").is_file() or not (tree / "specs").is_dir():
        return packaged
    return tree / "specs"


SPECS_DIR = _specs_dir()
RECIPES_DIR = SPECS_DIR / "recipes"
SUITES_DIR = SPECS_DIR / "suites"
ENGINES_DIR = SPECS_DIR / "engines"
PRESETS_PATH = SPECS_DIR / "presets.yaml"
DEFAULT_RECIPE = "fp8ref"


# --- presets -------------------------------------------------------------------------------

@functools.cache
def presets_document() -> YamlDocument:
    """``presets.yaml`` as loaded (``scheme.PRESETS`` validates it and builds the schemes)."""
    return load_yaml(PRESETS_PATH)


# --- recipes -------------------------------------------------------------------------------

@functools.cache
def recipe_names() -> tuple[str, ...]:
    """The names of the built-in recipes (file names, sorted), without parsing them."""
    return tuple(sorted(path.stem for path in RECIPES_DIR.glob("*.yaml")))


_LOADING = threading.RLock()  # threads that ask for a recipe at once parse its file once


@functools.cache
def load_recipes(directory: str | None = None) -> dict[str, Recipe | BlockRecipe]:
    """Every recipe in specs/recipes/*.yaml (or ``directory``), by name; read once. A document with
    ``kind: block`` is an MX/NVFP4 ``BlockRecipe``; the others are element-scale ``Recipe``s."""
    folder = path_arg(directory, "directory") if directory is not None else RECIPES_DIR
    return {path.stem: _recipe_file(path) for path in sorted(folder.glob("*.yaml"))}


def _recipe_file(path: Path) -> Recipe | BlockRecipe:
    with _LOADING:
        return _parse_recipe_file(path)


@functools.cache
def _parse_recipe_file(path: Path) -> Recipe | BlockRecipe:
    doc = load_yaml(path)
    is_block = isinstance(doc.data, dict) and doc.data.get("kind") == "block"
    recipe = block_recipe_from_document(doc) if is_block else recipe_from_document(doc)
    if recipe.name != path.stem:
        raise doc.error(("name",), f"expected the file name {path.stem!r}, got {recipe.name!r}")
    return recipe


def get_recipe(recipe: Recipe | BlockRecipe | str | None) -> Recipe | BlockRecipe:
    """A Recipe, or a built-in recipe's name (None -> 'fp8ref')."""
    if isinstance(recipe, (Recipe, BlockRecipe)):
        return recipe
    name = DEFAULT_RECIPE if recipe is None else recipe
    known = recipe_names()  # the built-in recipe's own file is parsed, not all 31 (70 ms of a verify)
    if not isinstance(name, str) or name not in known:
        raise RecipeError(f"recipe: unknown recipe {name!r}{did_you_mean(name, known, n=2, clause=True)} "
                          f"(known: {', '.join(known)})")
    return _builtin_recipe(name)


@functools.cache
def _builtin_recipe(name: str) -> Recipe | BlockRecipe:
    """A built-in recipe by its name (the name a key: the path built and hashed per call was most of
    get_recipe's cost, once per quantize)."""
    return _recipe_file(RECIPES_DIR / f"{name}.yaml")


# --- serving engines' load-time steps -------------------------------------------------------

def engine_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in ENGINES_DIR.glob("*.yaml")))


def engine_document(name: str) -> YamlDocument:
    """specs/engines/NAME.yaml as loaded (``fp8ref.checkpoint.engine`` validates it)."""
    if name not in engine_names():
        raise RecipeError(f"engine: unknown engine {name!r}{did_you_mean(name, engine_names(), n=2, clause=True)} "
                          f"(known: {', '.join(engine_names())})")
    return load_yaml(ENGINES_DIR / f"{name}.yaml")


# --- golden suites -------------------------------------------------------------------------

def suite_names() -> list[str]:
    return sorted(q.stem for q in SUITES_DIR.glob("*.yaml"))


def suite_path(name: str) -> Path | None:
    """The shipped suite called ``name`` (a bare name, no suffix or folder), None if there is none."""
    p = Path(name)
    if p.suffix or p.parent != Path("."):
        return None
    shipped = SUITES_DIR / f"{p.name}.yaml"
    return shipped if shipped.is_file() else None
