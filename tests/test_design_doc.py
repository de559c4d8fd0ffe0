"""docs/design.md names every module under zoo/ and no module that is gone, and the public API it shows is the
package's: the design is kept with the code it describes."""

import re
from pathlib import Path

import zoo

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def modules_on_disk() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "zoo").rglob("*.py")
            if p.name != "__init__.py" or p.parent == ROOT / "zoo"}


def modules_named() -> set[str]:
    return set(re.findall(r"`(zoo/[\w/]+\.py)`", DESIGN.read_text()))


def test_every_module_is_named():
    missing = sorted(modules_on_disk() - modules_named())
    assert not missing, f"docs/design.md's module map lacks {missing}"


def test_no_module_named_is_gone():
    gone = sorted(modules_named() - {p.relative_to(ROOT).as_posix() for p in (ROOT / "zoo").rglob("*.py")})
    assert not gone, f"docs/design.md names modules that do not exist: {gone}"


def test_public_api_names_are_the_packages():
    text = DESIGN.read_text()
    api = text[text.index("## Public API"):text.index("## The run contract")]
    missing = [name for name in zoo.__all__ if f"zoo.{name}" not in api]
    assert not missing, f"docs/design.md's public API lacks {missing}"
