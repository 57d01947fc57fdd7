"""Kubernetes value formats, checked the way the API server and the kubelet check them.

Each type carries its pattern into the generated CRD (pydantic's JSON schema), so `validate` and
the API server refuse the same strings. Patterns are RE2-compatible (no look-arounds).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import AfterValidator, StringConstraints, WithJsonSchema

# RFC 1123 subdomain: StorageClass, PriorityClass, scheduler and queue names.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# RFC 1123 label: namespaces.
DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# RFC 1035 label: Service names (and so job names, which name the job's Services).
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Resource names: `cpu`, `memory`, `nvidia.com/gpu`, `hugepages-2Mi`.
RESOURCE_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
QUANTITY = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?$"
# The container image reference grammar (registry[:port]/path[:tag][@digest]); the kubelet
# refuses anything else with InvalidImageName, after the pod was scheduled.
_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
_DOMAIN = r"([a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*(:[0-9]+)?"
IMAGE = (
    rf"^({_DOMAIN}/)?{_COMPONENT}(/{_COMPONENT})*(:[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
NATS_URL = r"^(nats|tls|ws|wss)://[^\s/,]+(,(nats|tls|ws|wss)://[^\s/,]+)*$"

DnsSubdomain = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
ImageRef = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=IMAGE)]

_BINARY: dict[str, int] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: dict[str, Decimal | int] = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def parse_quantity(value: int | str) -> Decimal:
    """A Kubernetes quantity ("500m", "1.5Gi", "1e3", 16) as a number; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f'expected a quantity such as 4, "500m" or "16Gi", got {value!r}')
    text = str(value)
    match = re.fullmatch(QUANTITY, text)
    if not match:
        raise ValueError(
            f'{text!r} is not a Kubernetes quantity (e.g. 4, "500m", "16Gi", "10G"; '
            f'units are Ki Mi Gi Ti Pi Ei or k M G T P E, not "GB")'
        )
    number, suffix = str(match.group(1)), match.group(3) or ""
    try:
        base = Decimal(number)
    except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    try:
        if suffix in _BINARY or suffix in _DECIMAL:  # "E" and "Ei" are units (exa), "e3" an exponent
            return base * Decimal(_BINARY.get(suffix) or _DECIMAL[suffix])
        return base * Decimal(10) ** int(suffix[1:])
    except ArithmeticError:  # decimal's Overflow: an exponent past what any quantity needs
        raise ValueError(f"{text!r} is too large for a Kubernetes quantity") from None


# What the API server reads where a pod's JSON has a quantity (apimachinery's
# Quantity.UnmarshalJSON: the string's surrounding space trimmed, then ParseQuantity, which takes
# a sign): "  32", "-1" and the JSON number 4096.5 are all quantities there. The spec's own fields
# keep the strict QUANTITY (their CRD pattern); a podTemplate's are read this way, so that the
# policy sees the number the kubelet will.
_SIGNED_QUANTITY = re.compile(r"[+-]?" + QUANTITY.lstrip("^").removeprefix(r"\+?").rstrip("$"))


def read_quantity(value: Any) -> Decimal:
    """A quantity as Kubernetes reads it from a manifest (a string, an integer, a float: a JSON
    number; null reads as 0); ValueError where Kubernetes could not read it either."""
    if value is None:
        return Decimal(0)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f'expected a quantity such as 4, "500m" or "16Gi", got {value!r}')
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{value!r} is not a Kubernetes quantity")
        return Decimal(repr(value))
    text = str(value).strip()
    if not _SIGNED_QUANTITY.fullmatch(text):
        raise ValueError(f"{str(value)!r} is not a quantity Kubernetes can read")
    sign = -1 if text.startswith("-") else 1
    return sign * parse_quantity(text.lstrip("+-"))


def _quantity(value: int | str) -> int | str:
    if parse_quantity(value) < 0:
        raise ValueError("must not be negative")
    return value


def _positive_quantity(value: int | str) -> int | str:
    if parse_quantity(value) <= 0:
        raise ValueError("must be greater than zero")
    return value


_INT_OR_STRING: dict[str, Any] = {
    "x-kubernetes-int-or-string": True,
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": QUANTITY,  # a string's (an unsigned quantity)
    "minimum": 0,  # an integer's
}
Quantity = Annotated[int | str, AfterValidator(_quantity), WithJsonSchema(_INT_OR_STRING)]
PositiveQuantity = Annotated[
    str, StringConstraints(max_length=64, pattern=QUANTITY), AfterValidator(_positive_quantity)
]
