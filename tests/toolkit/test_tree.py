"""Every container a wrapper or a function is handed is either seen into or refused with a
typed error that names the type and the fix: nothing goes through unseen.

One rule for all of them (isolate/_tree.py): Detached, Cloned, Frozen's input check,
stop_gradient, clone and scale_gradient.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import isolate
from isolate._tree import iter_tensors, map_tensors
from isolate.errors import IsolationTypeError


class Batch:
    """A PyG-style batch: a plain class that keeps its tensors as attributes."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor, num_graphs: int) -> None:
        self.x = x
        self.edge_index = edge_index
        self.num_graphs = num_graphs


class Store(collections.abc.Mapping):  # type: ignore[type-arg]
    """Like PyG's storage: a mapping kept inside a plain object."""

    def __init__(self, **items: torch.Tensor) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Wrapped:
    def __init__(self, **items: torch.Tensor) -> None:
        self._store = Store(**items)


class Slotted:
    __slots__ = ("x",)

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class Pair(NamedTuple):
    left: torch.Tensor
    right: Any


@dataclasses.dataclass
class WithCache:
    x: torch.Tensor

    def __post_init__(self) -> None:
        self.cache = self.x * 2  # a tensor outside the fields


class ReadsBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.lin(batch.x).sum()


def _trunk_and_batch() -> tuple[nn.Linear, Batch]:
    torch.manual_seed(0)
    trunk = nn.Linear(3, 3)
    return trunk, Batch(trunk(torch.randn(5, 3)), torch.zeros(2, 4, dtype=torch.long), 2)


@pytest.fixture
def registered() -> Iterator[None]:
    pytree.register_pytree_node(
        Batch,
        lambda b: ([b.x, b.edge_index], b.num_graphs),
        lambda children, n: Batch(*children, n),  # type: ignore[misc]
    )
    try:
        yield
    finally:
        pytree._deregister_pytree_node(Batch)


# Refusals name a class by its qualified name: this module's, wherever the tests are.
HERE = re.escape(__name__)
BATCH_REFUSED = (
    rf"cannot see into {HERE}\.Batch: expected tensors in a tuple, list, dict, "
    rf"dataclass or registered pytree node, got a {HERE}\.Batch holding 2 tensor\(s\) "
    r"at \.x, \.edge_index; .* Fix: register a flatten/unflatten rule with "
    r"torch\.utils\._pytree\.register_pytree_node\(Batch, flatten_fn, unflatten_fn\)"
)


def test_unwrapped_branch_leaks_through_a_plain_batch() -> None:
    """The negative control: without isolation the trunk receives gradient through .x."""
    trunk, batch = _trunk_and_batch()
    ReadsBatch()(batch).backward()
    assert trunk.weight.grad is not None and trunk.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("call", "caller"),
    [
        (lambda b: isolate.Detached(ReadsBatch())(b), r"Detached\(ReadsBatch\)"),
        (lambda b: isolate.Detached(ReadsBatch(), inplace="copy")(b), r"Detached\(ReadsBatch\)"),
        (lambda b: isolate.Cloned(ReadsBatch())(b), r"Cloned\(ReadsBatch\)"),
        (lambda b: isolate.Frozen(ReadsBatch())(b), r"Frozen\(ReadsBatch\)"),
        (lambda b: isolate.stop_gradient(b), r"stop_gradient\(\)"),
        (lambda b: isolate.clone({"batch": b}), r"clone\(\)"),
        (lambda b: isolate.scale_gradient([b], -1.0), r"scale_gradient\(\)"),
        (lambda b: isolate.scale_gradient(b, 0.0), r"scale_gradient\(\)"),
        (lambda b: isolate.GradientScale(0.5)(b), r"GradientScale\(\)"),
    ],
    # Plain ids: under the regexes' ids mutmut did not run these tests (a mutant they kill lived).
    ids=[
        "Detached",
        "Detached-copy",
        "Cloned",
        "Frozen",
        "stop_gradient",
        "clone",
        "scale_gradient-list",
        "scale_gradient-zero",
        "GradientScale",
    ],
)
def test_a_plain_object_holding_tensors_is_refused(
    call: Callable[[Batch], object], caller: str
) -> None:
    trunk, batch = _trunk_and_batch()
    with pytest.raises(IsolationTypeError, match=rf"^{caller}: {BATCH_REFUSED}"):
        call(batch)
    assert trunk.weight.grad is None


def test_a_registered_batch_is_detached_and_keeps_its_type(registered: None) -> None:
    trunk, batch = _trunk_and_batch()
    branch = isolate.Detached(ReadsBatch())
    branch(batch).backward()
    assert trunk.weight.grad is None  # nothing reached the trunk
    assert branch.module.lin.weight.grad is not None  # the branch still learns
    out = isolate.stop_gradient(batch)
    assert type(out) is Batch and out.num_graphs == 2 and not out.x.requires_grad
    assert torch.equal(out.x, batch.x) and out.edge_index is not batch.edge_index
    cloned = isolate.clone(batch)
    assert type(cloned) is Batch and cloned.x.data_ptr() != batch.x.data_ptr()
    assert cloned.x.grad_fn is not None  # still in the graph


def test_registered_batch_through_cloned_frozen_and_scale(registered: None) -> None:
    trunk, batch = _trunk_and_batch()
    torch.manual_seed(1)
    ReadsBatch()(batch).backward(retain_graph=True)
    reference = trunk.weight.grad.clone()  # type: ignore[union-attr]
    trunk.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    isolate.Cloned(ReadsBatch())(batch).backward(retain_graph=True)
    assert torch.equal(trunk.weight.grad, reference)  # type: ignore[arg-type]
    trunk.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    ReadsBatch()(isolate.scale_gradient(batch, -0.5)).backward(retain_graph=True)
    assert torch.equal(trunk.weight.grad, -0.5 * reference)  # type: ignore[arg-type]
    trunk.zero_grad(set_to_none=True)
    frozen = isolate.Frozen(ReadsBatch())
    # .x requires grad: gradient flows to the input, not into the parameters
    frozen(batch).backward(retain_graph=True)
    assert trunk.weight.grad is not None and frozen.module.lin.weight.grad is None
    frozen.unwrap()


def test_a_rule_without_children_passes_the_object_through_on_purpose() -> None:
    class Opaque:
        def __init__(self) -> None:
            self.table = torch.ones(2, requires_grad=True)

    pytree.register_pytree_node(Opaque, lambda o: ([], o), lambda _, o: o)
    try:
        thing = Opaque()
        assert isolate.stop_gradient(thing) is thing
    finally:
        pytree._deregister_pytree_node(Opaque)


def test_tensors_held_deeper_are_found_with_their_path() -> None:
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(
        IsolationTypeError,
        match=rf"^stop_gradient\(\): cannot see into {HERE}\.Wrapped: .* holding 1 "
        r"tensor\(s\) at \._store\['x'\];",
    ):
        isolate.stop_gradient([Wrapped(x=x)])
    with pytest.raises(IsolationTypeError, match=r"Slotted holding 1 tensor\(s\) at \.x;"):
        isolate.Detached(nn.Identity())(Slotted(x))
    with pytest.raises(IsolationTypeError, match=r"holding 2 tensor\(s\) at \._parameters"):
        isolate.Detached(nn.Identity())(nn.Linear(2, 2))  # a module passed as an input
    # The first three paths are named; the rest are counted.
    many = Wrapped(a=x, b=x * 2, c=x * 3, d=x * 4)
    with pytest.raises(
        IsolationTypeError,
        match=r"holding 4 tensor\(s\) at \._store\['a'\], \._store\['b'\], \._store\['c'\], "
        r"\.\.\.;",
    ):
        isolate.stop_gradient(many)


def test_sets_iterators_and_fields_beyond_the_dataclass_are_refused() -> None:
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(
        IsolationTypeError, match=r"^clone\(\): cannot see into set: .* Fix: pass a list or tuple"
    ):
        isolate.clone([{x}])
    with pytest.raises(
        IsolationTypeError, match=r"^stop_gradient\(\): got an iterator \(generator\); .* pass a"
    ):
        isolate.stop_gradient(t for t in [x])
    with pytest.raises(
        IsolationTypeError,
        match=rf"^Detached\(Identity\): the dataclass {HERE}\.WithCache holds tensors in "
        r"attributes that are not fields \(\['cache'\]\)",
    ):
        isolate.Detached(nn.Identity())(WithCache(x))


def test_standard_containers_keep_their_type() -> None:
    x = torch.ones(2, requires_grad=True)
    indices = torch.max(torch.stack([x, x * 2]), dim=0).indices
    tree = {
        "pair": Pair(x * 1, "tag"),
        "od": collections.OrderedDict(a=x * 2),
        "dd": collections.defaultdict(list, b=[x * 3]),
        "dq": collections.deque([x * 4]),
        "max": torch.max(torch.stack([x, x * 2]), dim=0),
        "user": collections.UserDict(c=x * 5),
        "ns": types.SimpleNamespace(d=x * 6, tag="t"),
        "size": torch.Size([2, 3]),
        "none": None,
    }
    out = isolate.stop_gradient(tree)
    assert {k: type(v) for k, v in out.items()} == {k: type(v) for k, v in tree.items()}
    assert out["dd"].default_factory is list and out["pair"].right == "tag"
    leaves = [
        out["pair"].left,
        out["od"]["a"],
        out["dd"]["b"][0],
        out["dq"][0],
        out["user"]["c"],
        out["ns"].d,
    ]
    assert [t.tolist() for t in leaves] == [[k, k] for k in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)]
    assert out["ns"].tag == "t" and tree["ns"].d.requires_grad
    assert not any(t.requires_grad for t in [*leaves, out["max"].values])
    assert torch.equal(out["max"].indices, indices)


def test_values_that_hold_no_tensor_pass_through() -> None:
    class Config:
        def __init__(self) -> None:
            self.scale = 2.0
            self.name = "cfg"

    config = Config()
    seen: list[Any] = []

    class Branch(nn.Module):
        def forward(self, x: torch.Tensor, cfg: Config, mode: str = "a") -> torch.Tensor:
            seen.append((cfg, mode))
            return x * cfg.scale

    x = torch.ones(2, requires_grad=True) * 1
    out = isolate.Detached(Branch())(x, config, mode="b")
    assert seen == [(config, "b")] and out.grad_fn is None and torch.equal(out, 2 * x)
    with pytest.raises(IsolationTypeError, match=r"^stop_gradient\(\): expected a tensor .* got "):
        isolate.stop_gradient(config)


def test_a_mapping_that_cannot_be_rebuilt_is_refused() -> None:
    class Fixed(collections.abc.Mapping):  # type: ignore[type-arg]
        def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
            self._d = {"a": a, "b": b}

        def __getitem__(self, key: str) -> torch.Tensor:
            return self._d[key]

        def __iter__(self) -> Iterator[str]:
            return iter(self._d)

        def __len__(self) -> int:
            return 2

    x = torch.ones(2, requires_grad=True)
    with pytest.raises(
        IsolationTypeError,
        match=rf"^stop_gradient\(\): cannot rebuild {HERE}\..*Fixed from its mapped items "
        r"\(TypeError: .*\); register a flatten/unflatten rule",
    ):
        isolate.stop_gradient(Fixed(x, x))


class _WithMask(list):  # type: ignore[type-arg]
    """A list subclass whose constructor copies a tensor over from outside its items."""

    source: torch.Tensor | None = None

    def __init__(self, items: list[torch.Tensor]) -> None:
        super().__init__(items)
        self.mask = _WithMask.source


def test_a_rebuilt_container_that_keeps_the_original_tensors_is_refused() -> None:
    _WithMask.source = torch.ones(2, requires_grad=True) * 1
    x = torch.ones(2, requires_grad=True) * 1
    batch = _WithMask([x])
    try:
        with pytest.raises(
            IsolationTypeError,
            match=r"^stop_gradient\(\): .*_WithMask rebuilt from its items still holds the "
            r"original tensors at \['\.mask'\], which are not reached; register ",
        ):
            isolate.stop_gradient(batch)
    finally:
        _WithMask.source = None


class _WithMasks(list):  # type: ignore[type-arg]
    """A list subclass whose constructor copies four tensors over from outside its items."""

    source: tuple[torch.Tensor, ...] = ()

    def __init__(self, items: list[torch.Tensor]) -> None:
        super().__init__(items)
        self.masks = list(_WithMasks.source)


def test_a_refusal_names_the_class_to_register_and_at_most_three_places() -> None:
    x = torch.ones(2, requires_grad=True)
    _WithMasks.source = tuple(x * k for k in range(4))
    try:
        with pytest.raises(IsolationTypeError) as e:
            isolate.stop_gradient(_WithMasks([x * 5]))
    finally:
        _WithMasks.source = ()
    assert str(e.value) == (
        f"stop_gradient(): {__name__}._WithMasks rebuilt from its items still holds the "
        f"original tensors at ['.masks[0]', '.masks[1]', '.masks[2]'], which are not "
        f"reached; register a flatten/unflatten rule with "
        f"torch.utils._pytree.register_pytree_node(_WithMasks, flatten_fn, unflatten_fn) so "
        f"that its tensors can be reached (a rule whose flatten_fn returns no children passes "
        f"it through on purpose), or pass the tensors in a tuple, list, dict or dataclass"
    )
    with pytest.raises(IsolationTypeError) as e:
        isolate.Detached(nn.Identity())(WithCache(x))
    assert str(e.value).endswith(
        "make them fields, or register a flatten/unflatten rule with "
        "torch.utils._pytree.register_pytree_node(WithCache, flatten_fn, unflatten_fn) so "
        "that its tensors can be reached (a rule whose flatten_fn returns no children passes "
        "it through on purpose), or pass the tensors in a tuple, list, dict or dataclass"
    )


class _Tagged(list):  # type: ignore[type-arg]
    """A list subclass with an attribute that holds no tensor."""

    def __init__(self, items: list[torch.Tensor]) -> None:
        super().__init__(items)
        self.tag = "batch"


def test_a_map_that_returns_its_tensors_keeps_a_container_whose_attributes_hold_none() -> None:
    x = torch.ones(2)
    out = map_tensors(lambda t: t, _Tagged([x]))
    assert type(out) is _Tagged and out[0] is x and out.tag == "batch"


class _OneSlot:
    __slots__ = "data"  # a single slot may be named by a bare string


class _WeakFirst:
    __slots__ = ("__weakref__", "x")


class _TwoSlots:
    __slots__ = ("a", "b")


@dataclasses.dataclass
class _DictSlot:
    __slots__ = ("__dict__",)
    x: torch.Tensor


def test_tensors_in_slots_are_found_whatever_the_slots_declare() -> None:
    x = torch.ones(2, requires_grad=True)
    one, weak, two = _OneSlot(), _WeakFirst(), _TwoSlots()
    one.data, weak.x, two.b = x, x, x  # two.a is left unset
    for obj, path in ((one, ".data"), (weak, ".x"), (two, ".b")):
        with pytest.raises(IsolationTypeError, match=rf"holding 1 tensor\(s\) at \{path};"):
            isolate.stop_gradient([obj])
    # A dataclass keeping its fields in a declared __dict__ slot has no attribute besides them.
    out = isolate.Detached(nn.Identity())(_DictSlot(x * 2))
    assert type(out) is _DictSlot and not out.x.requires_grad


class _Holder:
    __slots__ = ("__weakref__", "a")


class _Empty:
    pass


def test_the_look_into_an_unknown_object_stops_after_ten_thousand_objects() -> None:
    """The holder, its list and 9,998 empty objects are 10,000 objects: looked through; one
    more is too many. A weak reference to the holder is not an object it holds."""
    x = torch.ones(2, requires_grad=True)
    holder = _Holder()
    holder.a = [_Empty() for _ in range(9_998)]
    ref = weakref.ref(holder)
    assert isolate.stop_gradient([x, holder])[1] is holder
    holder.a.append(_Empty())
    with pytest.raises(
        IsolationTypeError, match=r"_Holder too large to look through \(10000 objects\)"
    ):
        isolate.stop_gradient([x, holder])
    assert ref() is holder


class _Three:
    def __init__(self, x: torch.Tensor) -> None:
        self.a, self.b, self.c = x, x * 2, x * 3


class _Unreadable(collections.abc.Mapping):  # type: ignore[type-arg]
    """A mapping whose items cannot be listed, with a tensor in an attribute."""

    def __init__(self, x: torch.Tensor) -> None:
        self.t = x

    def __getitem__(self, key: str) -> torch.Tensor:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("not iterable")

    def __len__(self) -> int:
        return 1


class _Outer:
    def __init__(self, inner: object) -> None:
        self.inner = inner


def test_the_look_for_held_tensors_names_each_place_and_skips_code() -> None:
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(IsolationTypeError, match=r"holding 3 tensor\(s\) at \.a, \.b, \.c; "):
        isolate.stop_gradient([_Three(x)])  # three places, no "..."
    with pytest.raises(IsolationTypeError, match=r"holding 1 tensor\(s\) at \.inner\.t; "):
        isolate.stop_gradient([_Outer(_Unreadable(x))])  # looked at as a plain object
    # Classes, functions and modules are not looked into (torch's namespace is huge).
    code = _Outer([torch, nn.Linear, torch.relu, len, _Three])
    assert isolate.stop_gradient([x, code])[1] is code


def test_the_walks_refuse_in_isolates_name_by_default() -> None:
    _, batch = _trunk_and_batch()
    with pytest.raises(IsolationTypeError, match=rf"^isolate: {BATCH_REFUSED}"):
        list(iter_tensors([batch]))
    with pytest.raises(IsolationTypeError, match=rf"^isolate: {BATCH_REFUSED}"):
        map_tensors(torch.Tensor.detach, [batch])


def test_iter_tensors_reaches_every_container_and_refuses_in_the_callers_name() -> None:
    x, y = torch.ones(1), torch.zeros(1)
    assert [id(t) for t in iter_tensors(Pair(x, (y,)), "me")] == [id(x), id(y)]  # a namedtuple
    assert [id(t) for t in iter_tensors(Store(a=x, b=y), "me")] == [id(x), id(y)]  # a Mapping
    _, batch = _trunk_and_batch()
    for holder in (
        {"k": batch},
        collections.OrderedDict(k=batch),  # a pytree node
        Pair(x, batch),
        Store(k=batch),  # type: ignore[arg-type]
    ):
        with pytest.raises(IsolationTypeError, match=rf"^me: {BATCH_REFUSED}"):
            list(iter_tensors(holder, "me"))


@dataclasses.dataclass
class _Fields:
    x: torch.Tensor
    rest: Any = None


def test_a_namespace_and_a_dataclass_are_walked_and_mapped_at_the_top_too() -> None:
    x, y = torch.ones(1), torch.zeros(1)
    assert [id(t) for t in iter_tensors(types.SimpleNamespace(a=x, b=y), "me")] == [id(x), id(y)]
    assert [id(t) for t in iter_tensors(_Fields(x, (y,)), "me")] == [id(x), id(y)]
    _, batch = _trunk_and_batch()
    for holder in (types.SimpleNamespace(b=batch), _Fields(x, batch)):
        with pytest.raises(IsolationTypeError, match=rf"^me: {BATCH_REFUSED}"):
            list(iter_tensors(holder, "me"))
    with pytest.raises(IsolationTypeError, match=r"^me: the dataclass .*WithCache holds tensors"):
        list(iter_tensors(WithCache(x), "me"))
    leaf = torch.ones(1, requires_grad=True)
    out = isolate.stop_gradient(_Fields(leaf * 2))  # a dataclass alone, not in a tuple
    assert type(out) is _Fields and not out.x.requires_grad and torch.equal(out.x, leaf * 2)


class _Tup(tuple):  # type: ignore[type-arg]
    """A tuple subclass that is no named tuple: rebuilt from one iterable."""


def test_map_tensors_rebuilds_every_container_and_refuses_in_the_callers_name() -> None:
    leaf = torch.ones(1, requires_grad=True)
    out = isolate.stop_gradient(_Tup((leaf * 2, leaf * 3)))
    assert type(out) is _Tup and [t.tolist() for t in out] == [[2.0], [3.0]]
    assert not any(t.requires_grad for t in out)
    _, batch = _trunk_and_batch()
    for holder in (
        collections.OrderedDict(k=batch),  # a pytree node
        Pair(leaf, batch),
        types.SimpleNamespace(b=batch),
        _Fields(leaf, batch),
        Store(k=batch),  # type: ignore[arg-type]
        _Tup((leaf, batch)),
    ):
        with pytest.raises(IsolationTypeError, match=rf"^stop_gradient\(\): {BATCH_REFUSED}"):
            isolate.stop_gradient(holder)
    with pytest.raises(
        IsolationTypeError,
        match=rf"^stop_gradient\(\): cannot rebuild {HERE}\.Store from its mapped items "
        r"\(TypeError: .*\); register a flatten/unflatten rule with "
        r"torch\.utils\._pytree\.register_pytree_node\(Store, flatten_fn, unflatten_fn\)",
    ):
        isolate.stop_gradient(Store(k=leaf))
