"""The refusal sites of the server code, read from runtime/server/*.py with `ast`
(tests/test_server_refusals.py gives each a row): every `bad(...)`, `APIError(...)`,
`error_response(...)`, `error_body(...)` call, every `no(key, ...)` call (one site per key), and
every `Response(status_code=4xx/5xx)`. A site is named `function: message template` ("{}" for
each interpolated value); its template is a list of parts, a literal string or None for an
interpolated value."""
from __future__ import annotations

import ast
import re
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "runtime" / "server"

MESSAGE_ARG = {"bad": 0, "APIError": 1, "error_response": 1, "error_body": 1}   # callee -> message position


class Sites(ast.NodeVisitor):
    """Collects {key: template parts} (a part is a literal string, or None for an interpolated
    value) for every refusal call in one module."""

    def __init__(self, tree: ast.Module):
        self.out: dict[str, list] = {}
        self.stack: list[ast.AST] = []
        # a helper nested in a function that raises with a template of its own parameters
        # (`no(k, why)`): each call of it is a site; the call inside it is not
        nested = [g for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                  for g in ast.walk(f) if g is not f and isinstance(g, ast.FunctionDef)]
        self.helpers = {f.name: f for f in nested if self._raises(f)}
        self.visit(tree)

    def _raises(self, f) -> bool:
        params = {a.arg for a in f.args.args}
        for c in ast.walk(f):
            if isinstance(c, ast.Call) and self._callee(c) in MESSAGE_ARG:
                msg = self._msg(c)
                if msg is not None and {n.id for n in ast.walk(msg) if isinstance(n, ast.Name)} & params:
                    return True
        return False

    @staticmethod
    def _callee(c: ast.Call):
        return c.func.id if isinstance(c.func, ast.Name) else None

    def _msg(self, c: ast.Call):
        i = MESSAGE_ARG[self._callee(c)]
        return c.args[i] if len(c.args) > i else next((k.value for k in c.keywords if k.arg == "message"), None)

    def visit_FunctionDef(self, node):
        self.stack.append(node)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_ClassDef = visit_FunctionDef

    def visit_Call(self, c: ast.Call):
        self.generic_visit(c)
        name, fn = self._callee(c), self.stack[-1] if self.stack else None
        where = ".".join(s.name for s in self.stack)
        if fn is not None and (fn.name in MESSAGE_ARG or fn.name in self.helpers):
            return                                   # inside a wrapper: its callers are the sites
        if name in MESSAGE_ARG:
            alts = self.alts(self._msg(c), {})
        elif name in self.helpers:
            h = self.helpers[name]
            inner = next(x for x in ast.walk(h) if isinstance(x, ast.Call) and self._callee(x) in MESSAGE_ARG)
            params = [a.arg for a in h.args.args]
            alts = []
            for bound in self.bindings(dict(zip(params, c.args))):
                alts += self.alts(self._msg(inner), bound, h)
        elif name == "Response":
            st = next((k.value for k in c.keywords if k.arg == "status_code"), None)
            if not (isinstance(st, ast.Constant) and st.value >= 400):
                return
            alts = [[f"<status {st.value}, no body>"]]
        else:
            return
        for parts in alts:
            key = base = f"{where}: " + "".join("{}" if p is None else p for p in parts)
            n = 1
            while key in self.out:                   # the same refusal raised at a second place
                n += 1
                key = f"{base} #{n}"
            self.out[key] = parts

    def bindings(self, args: dict) -> list[dict]:
        """The call's arguments, a name bound by `for k in ("a", "b")` expanded per value."""
        out = [{}]
        for p, e in args.items():
            opts = self.alts(e, {})
            out = [dict(b, **{p: o}) for b in out for o in opts]
        return out

    def alts(self, e, bound: dict, fn=None) -> list[list]:
        """The message templates an expression can produce."""
        fn = fn or (self.stack[-1] if self.stack else None)
        if e is None:
            return [[None]]
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return [[e.value]]
        if isinstance(e, ast.JoinedStr):
            out = [[]]
            for v in e.values:
                sub = self.alts(v.value, bound, fn) if isinstance(v, ast.FormattedValue) and v.format_spec is None \
                    else self.alts(v, bound, fn)
                sub = sub if len(sub) == 1 else [[None]]
                out = [o + s for o in out for s in sub]
            return out
        if isinstance(e, ast.IfExp):
            return self.alts(e.body, bound, fn) + self.alts(e.orelse, bound, fn)
        if (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "get"
                and isinstance(e.func.value, ast.Dict)):
            return [p for v in e.func.value.values + e.args[1:] for p in self.alts(v, bound, fn)]
        if isinstance(e, ast.Name):
            if e.id in bound:
                return [bound[e.id]]
            defs = (ast.FunctionDef, ast.AsyncFunctionDef)
            scope = [s for s in self.stack if isinstance(s, defs)] + ([fn] if fn else [])
            for s in reversed(scope):
                assigns = [a.value for a in ast.walk(s) if isinstance(a, ast.Assign)
                           and [getattr(t, "id", None) for t in a.targets] == [e.id]]
                loops = [f.iter for f in ast.walk(s) if isinstance(f, ast.For)
                         and getattr(f.target, "id", None) == e.id and isinstance(f.iter, ast.Tuple)]
                if len(assigns) == 1 and not loops:
                    return self.alts(assigns[0], bound, s)
                if loops and not assigns:
                    return [p for x in loops[0].elts for p in self.alts(x, bound, s)]
        return [[None]]


def refusal_sites() -> dict[str, list]:
    """{`module.function: message template`: template parts} of every refusal site in runtime/server/."""
    out = {}
    for path in sorted(SERVER.glob("*.py")):
        for key, parts in Sites(ast.parse(path.read_text())).out.items():
            out[f"{path.stem}.{key}"] = parts
    return out


SITES = refusal_sites()


def pattern(parts) -> re.Pattern:
    return re.compile("".join(".*" if p is None else re.escape(p) for p in parts), re.S)


def literal_len(parts) -> int:
    return sum(len(p) for p in parts if p is not None)


def site_of(ref: str) -> str:
    """The site a row names: the key equal to `ref`, else the one key containing it."""
    if ref in SITES:
        return ref
    hits = [k for k in SITES if ref in k]
    assert len(hits) == 1, f"row site {ref!r} matches {hits or 'no site'}"
    return hits[0]
