"""The TypeScript client's error classes are the status table of ``kernel/errors.py``:
``clients/typescript/src/errors.gen.ts`` is what ``scripts/ts_errors.py`` writes now."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from baton_relay.kernel import errors

ROOT = Path(__file__).resolve().parents[2]


def _script() -> object:
    spec = importlib.util.spec_from_file_location("ts_errors", ROOT / "scripts" / "ts_errors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_classes_are_current() -> None:
    """The committed file is what the script writes from the table as it is."""
    script = _script()
    written = (ROOT / "clients" / "typescript" / "src" / "errors.gen.ts").read_text()
    assert written == script.render(), "run python scripts/ts_errors.py"  # type: ignore[attr-defined]


def test_every_error_has_its_class_code_and_parent() -> None:
    """One class per error of the table, under the same parent, with the same code and
    exit status; the transport's codes map to the same errors."""
    text = _script().render()  # type: ignore[attr-defined]
    classes = dict(re.findall(r"export class (\w+) extends (\w+)", text))
    assert set(classes) == errors.ERROR_NAMES
    for name in errors.ERROR_NAMES - {"BatonError"}:
        cls = getattr(errors, name)
        assert classes[name] == cls.__bases__[0].__name__, name
        body = text.split(f"export class {name} extends", 1)[1].split("\n}\n", 1)[0]
        assert f"exitCode: number = {cls.exit_code};" in body, name
        own = re.search(r'code: string = "(\w+)"', body)
        assert (own.group(1) if own else cls.__bases__[0].code.name) == cls.code.name, name
    transport = dict(re.findall(r"^  (\w+): (\w+),$", text.split("TRANSPORT", 1)[1], re.M))
    assert transport == {code: cls.__name__ for code, cls in errors._TRANSPORT.items()}
