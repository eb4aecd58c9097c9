"""Hypothesis strategies for HTTP requests, generated from the app's own OpenAPI schema.

``requests_from_openapi(schema, ...)`` walks every operation of the schema and draws ``FuzzCase``s:

* ``valid``: a body drawn from the operation's request schema (``$ref``, ``anyOf``, ``enum``/
  ``const``, string/array lengths, integer/number bounds, ``required``, ``additionalProperties``),
  with per-field overrides (``hints``) that keep the values the schema cannot describe (a ``WxH``
  size under the app's limits) valid and cheap most of the time;
* ``mutated``: a schema body with one change (a field of the wrong type, an unknown field, a missing
  required field, an out-of-range number, a lone surrogate in a string);
* ``raw``: bodies that are not what the schema says at all (random JSON, broken JSON, non-UTF-8
  bytes, a body over the size limit, a wrong content type);
* each case goes with the API key, a wrong key or none.

A case knows whether it *must* succeed (``expect_ok``: a valid body the hints kept inside the
limits, with the right key); every case must get an answer below 500 in time.
"""
import dataclasses
import json
from typing import Callable, Dict, Optional

from hypothesis import strategies as st

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=10)
# str with lone surrogates: valid JSON when escaped ("\\ud800"), not encodable as UTF-8 in the server
SURROGATE_TEXT = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)


@dataclasses.dataclass
class FuzzCase:
    method: str
    path: str
    content: Optional[bytes]
    headers: Dict[str, str]
    kind: str               # valid | mutated | raw
    expect_ok: bool         # must answer 200

    def describe(self) -> str:
        body = (self.content or b"")[:300]
        return f"{self.method} {self.path} [{self.kind}] headers={self.headers} body={body!r}"


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def from_schema(schema: dict, root: dict, hints: Dict[str, st.SearchStrategy], name: str = "") -> st.SearchStrategy:
    """Values valid for ``schema`` (with ``hints`` overriding properties by name)."""
    schema = _resolve(schema, root)
    if name in hints:
        return hints[name]
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s, root, hints) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -2**63 - 1) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 2**63 + 1) - 1)
        return st.integers(lo, hi)
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), root, hints),
                        min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 5), 5))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fixed = {k: from_schema(v, root, hints, k) for k, v in props.items() if k in required}
        optional = {k: from_schema(v, root, hints, k) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(fixed, optional=optional)
    return ANY_JSON


def _wrong_type(schema: dict, root: dict) -> st.SearchStrategy:
    schema = _resolve(schema, root)
    kinds = {s.get("type") for s in schema.get("anyOf", [schema])}
    options = []
    if not kinds & {"integer", "number"}:
        options.append(st.integers(-5, 10**6))
    if "string" not in kinds:
        options.append(st.text(max_size=8))
    if "boolean" not in kinds:
        options.append(st.booleans())
    options += [st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)]
    if kinds & {"integer"} and "number" not in kinds:
        options.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)))
        options.append(st.integers(1, 8).map(str))  # "2": no coercion in the strict models
    return st.one_of(options)


@st.composite
def _mutated(draw, schema: dict, root: dict, hints) -> dict:
    schema = _resolve(schema, root)
    body = dict(draw(from_schema(schema, root, hints)))
    props = schema.get("properties", {})
    how = draw(st.sampled_from(["wrong_type", "unknown_field", "drop_required", "out_of_range", "surrogate"]))
    field = draw(st.sampled_from(sorted(props))) if props else None
    if how == "wrong_type" and field:
        body[field] = draw(_wrong_type(props[field], root))
    elif how == "unknown_field":
        extra = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in props))
        body[extra] = draw(JSON_SCALARS)
    elif how == "drop_required" and schema.get("required"):
        body.pop(draw(st.sampled_from(schema["required"])), None)
    elif how == "out_of_range" and field:
        body[field] = draw(st.sampled_from([-1, 0, 10**9, 2**64, -2**64, 1e308, -0.5]))
    elif field:
        body[field] = draw(SURROGATE_TEXT)
    return body


def _raw_bodies(max_body_bytes: int) -> st.SearchStrategy:
    return st.one_of(
        ANY_JSON.map(lambda v: (json.dumps(v).encode(), "application/json")),
        st.binary(max_size=64).map(lambda b: (b, "application/json")),                      # junk
        st.binary(min_size=1, max_size=32).map(lambda b: (b"\xff\xfe" + b, "application/json")),  # not UTF-8
        st.text(max_size=16).map(lambda t: (json.dumps({"prompt": t}).encode("utf-16"), "application/json")),
        st.sampled_from([b"{", b"[]", b"null", b'{"prompt": NaN}', b'{"prompt": "x", "n": Infinity}',
                         b"[" * 5000, b'{"prompt": "a", "prompt": 3}']).map(lambda b: (b, "application/json")),
        st.integers(1, 3).map(lambda k: (b'{"prompt": "' + b"a" * (max_body_bytes * k) + b'"}',
                                         "application/json")),                              # too large
        st.binary(max_size=32).map(lambda b: (b, "text/plain")),
        st.just((b"", "application/json")),
        st.binary(max_size=64).map(lambda b: (b"--bcg\r\n" + b, "multipart/form-data; boundary=bcg")),  # junk form
        st.just((b"", "multipart/form-data")),                                              # no boundary
    )


def _png(side: int = 16) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


@st.composite
def _form_case(draw, method, path, headers, auth, hints, is_cheap_and_valid, max_body_bytes):
    """An edit's multipart form: fields from the hints (prompt, size, n, steps) and ``strength``, with an image
    file (a small PNG, or junk bytes), or a raw body; ``expect_ok`` where the fields keep it valid."""
    if draw(st.integers(0, 9)) < 3:
        content, ctype = draw(_raw_bodies(max_body_bytes))
        return FuzzCase(method, path, content, {**headers, "content-type": ctype}, "raw", False)
    fields = {name: draw(hints[name]) for name in ("prompt", "size", "n", "num_inference_steps") if name in hints}
    fields["strength"] = draw(st.one_of(st.none(), st.floats(-0.5, 1.5)))
    fields = {k: v for k, v in fields.items() if v is not None}
    image = draw(st.sampled_from([_png(), _png(8), b"not a picture"]))
    boundary = "bcgfuzz"
    parts = []
    for name, value in fields.items():
        text = str(value).encode("utf-8", "surrogatepass")
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + text + b"\r\n")
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="in.png"\r\n'
                 f"Content-Type: image/png\r\n\r\n".encode() + image + b"\r\n")
    content = b"".join(parts) + f"--{boundary}--\r\n".encode()
    ok = (auth == "key" and image != b"not a picture" and isinstance(fields.get("prompt"), str)
          and "\r" not in fields["prompt"] and is_cheap_and_valid(path, fields))
    return FuzzCase(method, path, content, {**headers, "content-type": f"multipart/form-data; boundary={boundary}"},
                    "valid", ok)


def requests_from_openapi(schema: dict, hints: Dict[str, st.SearchStrategy], is_cheap_and_valid: Callable,
                          api_key: str, max_body_bytes: int) -> st.SearchStrategy:
    """FuzzCases over every operation of ``schema`` (see the module docstring)."""
    cases = []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {})
            body_schema = content.get("application/json", {}).get("schema")
            # a multipart route (POST /v1/images/edits): forms drawn from its fields, or raw bodies
            cases.append((method.upper(), path, "multipart" if "multipart/form-data" in content else body_schema))

    @st.composite
    def one(draw):
        method, path, body_schema = draw(st.sampled_from(cases))
        auth = draw(st.sampled_from(["key"] * 8 + ["none", "wrong"]))
        headers = {}
        if auth == "key":
            headers["authorization"] = f"Bearer {api_key}"
        elif auth == "wrong":
            headers["authorization"] = draw(st.sampled_from([f"Bearer {api_key}x", "Bearer", "Basic abc",
                                                             f"bearer {api_key[:-1]}"]))
        if body_schema is None:
            return FuzzCase(method, path, None, headers, "valid", auth == "key")
        if body_schema == "multipart":
            return draw(_form_case(method, path, headers, auth, hints, is_cheap_and_valid, max_body_bytes))
        kind = draw(st.sampled_from(["valid"] * 5 + ["mutated"] * 3 + ["raw"] * 2))
        if kind == "raw":
            content, ctype = draw(_raw_bodies(max_body_bytes))
            headers["content-type"] = ctype
            return FuzzCase(method, path, content, headers, kind, False)
        if kind == "valid":
            body = draw(from_schema(body_schema, schema, hints))
        else:
            body = draw(_mutated(body_schema, schema, hints))
        headers["content-type"] = "application/json"
        content = json.dumps(body).encode()
        ok = kind == "valid" and auth == "key" and len(content) <= max_body_bytes and is_cheap_and_valid(path, body)
        return FuzzCase(method, path, content, headers, kind, ok)

    return one()
