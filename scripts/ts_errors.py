"""Write the TypeScript client's error classes from the status table of
``kernel/errors.py``: one class per Baton error, with the same name, parent, gRPC
status code and CLI exit status, and the map of transport codes. The TypeScript
client and the Python one then read a registry's errors alike.

    python scripts/ts_errors.py            # writes clients/typescript/src/errors.gen.ts
    python scripts/ts_errors.py --check    # exits 1 if that file is not what it writes

``tests/unit/test_ts_errors.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "clients" / "typescript" / "src" / "errors.gen.ts"


def _table() -> tuple[list[tuple[str, str, str, int, str]], dict[str, str]]:
    """(name, parent, code, exit code, doc) of every error, parents first; and the
    transport's code → name map."""
    sys.path.insert(0, str(ROOT.parent))
    from baton_relay.kernel import errors

    classes = [errors.BatonError, *sorted(errors._BY_NAME.values(), key=lambda c: c.__name__)]
    ordered: list[type[errors.BatonError]] = []

    def add(cls: type[errors.BatonError]) -> None:
        if cls in ordered:
            return
        parent = cls.__bases__[0]
        if parent is not Exception:
            add(parent)
        ordered.append(cls)

    for cls in classes:
        add(cls)
    rows = []
    for cls in ordered:
        parent = cls.__bases__[0]
        doc = " ".join((cls.__doc__ or "").split())
        rows.append((cls.__name__, "Error" if parent is Exception else parent.__name__,
                     cls.__dict__["code"].name if "code" in cls.__dict__ else "",
                     int(cls.exit_code), doc))
    transport = {code: cls.__name__ for code, cls in errors._TRANSPORT.items()}
    return rows, transport


def render() -> str:
    rows, transport = _table()
    out = [
        "// Written by scripts/ts_errors.py from kernel/errors.py: do not edit.",
        "// Baton's errors, as the registry names them in the `baton-error` trailer.",
        "",
        "/** Root of every error Baton raises on purpose. */",
        "export class BatonError extends Error {",
        "  /** the gRPC status code's name, e.g. \"NOT_FOUND\" */",
        "  static readonly code: string = \"INTERNAL\";",
        "  /** the `baton` CLI's exit status for this error */",
        "  static readonly exitCode: number = 1;",
        "  /** the fields the registry sent with it (`baton-fields`) */",
        "  readonly fields: Record<string, unknown>;",
        "",
        "  constructor(message: string, fields: Record<string, unknown> = {}) {",
        "    super(message);",
        "    this.name = new.target.errorName;",
        "    this.fields = fields;",
        "  }",
        "",
        "  /** the error's name in the status table (what `baton-error` carries) */",
        "  static get errorName(): string {",
        "    return \"BatonError\";",
        "  }",
        "",
        "  /** this error's gRPC status code's name */",
        "  get code(): string {",
        "    return (this.constructor as typeof BatonError).code;",
        "  }",
        "}",
    ]
    for name, parent, code, exit_code, doc in rows:
        if name == "BatonError":
            continue
        out += ["", f"/** {doc} */" if doc else "", f"export class {name} extends {parent} {{"]
        if code:
            out.append(f"  static override readonly code: string = {code!r};".replace("'", '"'))
        out += [f"  static override readonly exitCode: number = {exit_code};",
                "  static override get errorName(): string {",
                f"    return \"{name}\";",
                "  }",
                "}"]
    out += ["", "/** Every error of the table, by its name. */",
            "export const ERRORS: Readonly<Record<string, typeof BatonError>> = {"]
    out += [f"  {name}," for name, *_ in rows]
    out += ["};", "",
            "/** The error a status without a `baton-error` name becomes (it came from the",
            " * transport or a proxy, not a registry's handler); any other code: Internal. */",
            "export const TRANSPORT: Readonly<Record<string, typeof BatonError>> = {"]
    out += [f"  {code}: {name}," for code, name in transport.items()]
    out += ["};", ""]
    return "\n".join(line for i, line in enumerate(out) if line or out[i - 1] != "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the file is not what this script writes")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET.relative_to(ROOT)} is out of date: run python scripts/ts_errors.py",
                  file=sys.stderr)
            return 1
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
