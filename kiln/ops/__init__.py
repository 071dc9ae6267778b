"""One home per op: the semantics of kiln's pointwise ops, below the frontend and lowering.

- `build.py`  Loop IR expression builders the op bodies and lowering share (`op`, `const`,
              `cast`, `to_bool`)
- `table.py`  `ROWS`: one row per kiln pointwise op (Graph IR name, arity, dtype rule, operand
              conversions, the body building its Loop IR expression, the attributes it reads,
              its torch eager twin) and `FORMS`: named specialisations of a row (gelu_tanh =
              gelu with approximate="tanh", clamp with both bounds, relu6)
- `match.py`  "is this expression form F of some operands?": the pattern is the row's own
              body built on placeholder operands, so recognisers (GEMM epilogue fusion) follow
              the single definition

The frontend maps aten overloads to row names, lowering applies rows, epilogue fusion matches
forms; targets spell the Loop IR operators the bodies emit (kiln/targets/*/ops.py)."""

from kiln.ops.match import Match, match, pattern, is_primitive
from kiln.ops.table import FORMS, ROWS, Form, Row, form

__all__ = ["FORMS", "ROWS", "Form", "Match", "Row", "form", "is_primitive", "match", "pattern"]
