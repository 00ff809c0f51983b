"""The one mechanism every Hugging Face family shares: declared name pairs, each with a reversible transform.

A family declares ``Rule``s: our name (``blocks.{i}.attn.qkv.weight``, ``{i}`` the layer), the Hugging
Face name or names it becomes (several where we fuse what they keep apart: q/k/v, gate/up) and the
``Transform`` between them, plus ``Tie``s (names that are copies of others) and ``Stacked`` tensors (one
Hugging Face tensor holding every expert's, as ``transformers`` 5 keeps them in memory). ``StateDictMapping``
expands the rules for one config over the names our model really has, so an optional tensor (a
bias, a position table) needs no condition in any family, and does every check in one place:
missing, unexpected and wrongly shaped names, ties, and names no rule covers.

Conversion works entry by entry (one of our tensors and its Hugging Face parts), which is what lets
an export read and write a few tensors at a time (``plan_shards``, ``hf_tensors``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import torch
from torch import Tensor, nn

Shape = tuple[int, ...]
OURS_FIX = ("Pass the full, unsharded state dict of a model with this config: under tensor or pipeline parallelism, "
            "gather it on every rank with Megatron3DStrategy.full_state_dict() and convert it on one.")


# ----------------------------------------------------------------------------- transforms
def _transposed(tensor: Tensor) -> Tensor:
    return tensor.t().contiguous() if tensor.dim() == 2 else tensor.contiguous()


def _own_memory(tensor: Tensor) -> Tensor:
    # views of one tensor would share memory, which safetensors refuses to save
    return tensor.clone(memory_format=torch.contiguous_format)


class Transform:
    """How one of our tensors becomes Hugging Face tensors (``to_hf``) and back (``to_ours``); the base class
    is the identity. Every transform works on weights and on 1-D biases alike."""

    def to_hf(self, tensor: Tensor) -> tuple[Tensor, ...]:
        return (tensor,)

    def to_ours(self, tensors: Sequence[Tensor]) -> Tensor:
        return tensors[0]

    def hf_shapes(self, shape: Shape) -> tuple[Shape, ...]:
        return (shape,)


SAME = Transform()


class Transpose(Transform):
    """GPT-2's ``Conv1D`` stores weights ``[in, out]``; ours are ``nn.Linear``'s ``[out, in]`` (biases unchanged)."""

    def to_hf(self, tensor: Tensor) -> tuple[Tensor, ...]:
        return (_transposed(tensor),)

    def to_ours(self, tensors: Sequence[Tensor]) -> Tensor:
        return _transposed(tensors[0])

    def hf_shapes(self, shape: Shape) -> tuple[Shape, ...]:
        return (shape[::-1],)


TRANSPOSE = Transpose()


@dataclass(frozen=True)
class QueryGroups(Transform):
    """Our fused ``qkv``, laid out by query group (``[group, (its query heads, k, v), head_dim]`` rows, so a
    contiguous tp split hands out whole groups) <-> separate ``q`` ``[heads * d]``, ``k`` and ``v``
    ``[groups * d]`` rows. ``groups == heads`` is multi-head attention: head-major ``[head, (q, k, v), d]``."""

    heads: int
    groups: int

    def to_hf(self, tensor: Tensor) -> tuple[Tensor, ...]:
        per_group = self.heads // self.groups
        q, k, v = tensor.unflatten(0, (self.groups, per_group + 2, -1)).split([per_group, 1, 1], dim=1)
        return tuple(_own_memory(part.flatten(0, 2)) for part in (q, k, v))

    def to_ours(self, tensors: Sequence[Tensor]) -> Tensor:
        q, k, v = tensors
        parts = [q.unflatten(0, (self.groups, self.heads // self.groups, -1)),
                 k.unflatten(0, (self.groups, 1, -1)), v.unflatten(0, (self.groups, 1, -1))]
        return torch.cat(parts, dim=1).flatten(0, 2)

    def hf_shapes(self, shape: Shape) -> tuple[Shape, ...]:
        head_dim, rest = shape[0] // (self.heads + 2 * self.groups), tuple(shape[1:])
        return (self.heads * head_dim, *rest), (self.groups * head_dim, *rest), (self.groups * head_dim, *rest)


@dataclass(frozen=True)
class GPT2QKV(Transform):
    """GPT-2's ``c_attn``: one ``Conv1D`` whose output is ``[q; k; v]``; ours is head-major (``QueryGroups``
    with one query head per group), then transposed."""

    heads: int

    def to_hf(self, tensor: Tensor) -> tuple[Tensor, ...]:
        return (_transposed(torch.cat(QueryGroups(self.heads, self.heads).to_hf(tensor))),)

    def to_ours(self, tensors: Sequence[Tensor]) -> Tensor:
        return QueryGroups(self.heads, self.heads).to_ours(_transposed(tensors[0]).chunk(3)).contiguous()

    def hf_shapes(self, shape: Shape) -> tuple[Shape, ...]:
        return (shape[::-1],)


@dataclass(frozen=True)
class Chunks(Transform):
    """Our rows ``[c_0; c_1; ...]`` fused in one tensor (SwiGLU's ``[gate; up]``) <-> ``parts`` equal tensors."""

    parts: int = 2

    def to_hf(self, tensor: Tensor) -> tuple[Tensor, ...]:
        return tuple(_own_memory(chunk) for chunk in tensor.chunk(self.parts))

    def to_ours(self, tensors: Sequence[Tensor]) -> Tensor:
        return torch.cat(list(tensors))

    def hf_shapes(self, shape: Shape) -> tuple[Shape, ...]:
        return ((shape[0] // self.parts, *shape[1:]),) * self.parts


# ----------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Rule:
    """Our name <-> the Hugging Face name(s) of its parts; ``{i}`` in both stands for the layer index."""

    ours: str
    theirs: tuple[str, ...]
    transform: Transform = SAME


def pair(ours: str, theirs: Union[str, Sequence[str]], transform: Transform = SAME) -> list[Rule]:
    """The rules of a module with a weight and (if our model has one) a bias, e.g.
    ``pair("blocks.{i}.mlp.fc", ("...gate_proj", "...up_proj"), Chunks(2))``."""
    modules = (theirs,) if isinstance(theirs, str) else tuple(theirs)
    return [Rule(f"{ours}.{kind}", tuple(f"{module}.{kind}" for module in modules), transform)
            for kind in ("weight", "bias")]


@dataclass(frozen=True)
class Tie:
    """``copy`` is the same tensor as ``original`` (``why`` says who ties them, for the error when they differ)."""

    copy: str
    original: str
    why: str


@dataclass(frozen=True)
class Stacked:
    """A Hugging Face tensor stacking one tensor per expert along dim 0, each expert's slice being ``parts`` fused
    along its first dim, <-> the per-expert names the rules use (``{i}``: the layer, ``{e}``: the expert).

    ``transformers`` 5 keeps a layer's experts so in memory (``mlp.experts.gate_up_proj`` ``[E, 2f, h]``, gate
    then up; ``mlp.experts.down_proj`` ``[E, h, f]``), but ``save_pretrained`` writes, and checkpoints on the Hub
    hold, one tensor per expert and projection (``experts.{e}.gate_proj.weight``), which ``from_pretrained``
    stacks when it loads. The rules name the stored tensors, so every entry stays one of our tensors (an
    expert's ``fc``) and its parts and an export writes what ``save_pretrained`` writes; reading splits stacked
    tensors first (``StateDictMapping.unstacked``), so a model's own state dict converts too.

    ``written``: the family's checkpoints store the stack itself (GPT-OSS's ``experts.gate_up_proj``): the parts are
    then names of the rules only, and an export stacks them back (every expert of a layer in one shard).
    """

    stacked: str  # e.g. "model.layers.{i}.mlp.experts.gate_up_proj"
    parts: tuple[str, ...]  # e.g. ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "...up_proj.weight")
    written: bool = False

    def part_pattern(self, layer: int) -> "re.Pattern[str]":
        """Matches the names of this stack's parts in ``layer``, any expert."""
        return re.compile("|".join(re.escape(part.format(i=layer, e="EXPERT")).replace("EXPERT", r"\d+")
                                   for part in self.parts))

    def stack(self, hf: dict[str, Tensor], layer: int) -> None:
        """Replace the parts of ``layer`` in ``hf`` (experts ``0, 1, ...`` while there) by the stacked tensor."""
        experts = []
        while self.parts[0].format(i=layer, e=len(experts)) in hf:
            expert = len(experts)
            experts.append(torch.cat([hf.pop(part.format(i=layer, e=expert)) for part in self.parts]))
        if experts:
            hf[self.stacked.format(i=layer)] = torch.stack(experts)


@dataclass(frozen=True)
class Texts:
    """How errors name the two state dicts, and the fix for a Hugging Face one that does not fit."""

    hf: str  # e.g. "The Hugging Face GPT-2 state dict"
    hf_fix: str
    ours: str  # e.g. "The GPT state dict"


@dataclass(frozen=True)
class Entry:
    """One of our tensors and its Hugging Face parts, for one config."""

    ours: str
    theirs: tuple[str, ...]
    transform: Transform


# ----------------------------------------------------------------------------- checks
def raise_problems(problems: list[str], *, what: str, fix: str = "") -> None:
    """One ``ValueError`` listing every problem, then the fix; nothing when there are none."""
    if problems:
        raise ValueError(f"{what}:\n  - " + "\n  - ".join(problems) + (f"\n{fix}" if fix else ""))


def check_extra_fields(architecture: Mapping[str, Any], extra_fields: Mapping[str, Any], *, config: Any) -> None:
    """Refuse ``config.json`` extras that would overwrite a field our ``config`` decides."""
    clashes = sorted(architecture.keys() & extra_fields.keys())
    if clashes:
        name = type(config).__name__
        raise ValueError(f"extra_fields {clashes} describe the architecture, which comes from the {name}; "
                         f"change the {name} instead.")


def check_names_and_shapes(shapes: Mapping[str, Shape], expected: Mapping[str, Shape], *, what: str, fix: str) -> None:
    """Refuse missing, unexpected or wrongly shaped entries (``shapes``: name -> shape), naming a few of each."""
    def listed(items: list[str]) -> str:
        return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")

    missing = sorted(expected.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - expected.keys())
    wrong = [f"{name} {tuple(shapes[name])} (expected {tuple(expected[name])})"
             for name in expected if name in shapes and tuple(shapes[name]) != tuple(expected[name])]
    problems = [f"{label}: {listed(items)}" for label, items in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
    raise_problems(problems, what=f"{what} does not match the config", fix=fix)


def check_tied(state: Mapping[str, Tensor], tie: Tie, *, what: str) -> None:
    """Refuse ``state`` when the tied copy differs from its original."""
    if not torch.equal(state[tie.copy], state[tie.original]):
        raise ValueError(f"{what}: {tie.copy} differs from {tie.original}, but {tie.why}. A model where they differ "
                         f"cannot be converted.")


def state_dict_shapes(model_class: Callable[[Any], nn.Module], config: Any) -> dict[str, Shape]:
    """Name -> shape of ``model_class(config)``'s full state dict, built on the meta device (free at any size)."""
    with torch.device("meta"):
        return {name: tuple(value.shape) for name, value in model_class(config).state_dict().items()}


def _shapes(tensors: Mapping[str, Tensor]) -> dict[str, Shape]:
    return {name: tuple(value.shape) for name, value in tensors.items()}


def _fill_ties(state: dict[str, Tensor], ties: Iterable[Tie]) -> None:
    """A tied pair stored once (as save_pretrained stores it) gets its other name back."""
    for tie in ties:
        if tie.copy not in state and tie.original in state:
            state[tie.copy] = state[tie.original]
        elif tie.original not in state and tie.copy in state:
            state[tie.original] = state[tie.copy]


# ----------------------------------------------------------------------------- one config's mapping
@dataclass(frozen=True)
class StateDictMapping:
    """Every entry of one config's model (in file order), the ties on both sides, the stacked Hugging Face tensors
    of each layer (``(Stacked, layer)``), and the checks."""

    entries: tuple[Entry, ...]
    our_shapes: Mapping[str, Shape]
    our_ties: tuple[Tie, ...]
    their_ties: tuple[Tie, ...]
    texts: Texts
    stacks: tuple[tuple[Stacked, int], ...] = ()

    @classmethod
    def build(cls, our_shapes: Mapping[str, Shape], *, num_layers: int, first: Sequence[Rule], layer: Sequence[Rule],
              last: Sequence[Rule], texts: Texts, our_ties: Sequence[Tie] = (), their_ties: Sequence[Tie] = (),
              stacked: Sequence[Stacked] = ()) -> "StateDictMapping":
        """``first`` and ``last`` rules once, ``layer`` rules (and ``stacked`` tensors) for each layer between them;
        a rule whose name our model does not have (``our_shapes``) is skipped. Every name our model has must be
        covered."""
        expanded = [(rule, None) for rule in first]
        expanded += [(rule, index) for index in range(num_layers) for rule in layer]
        expanded += [(rule, None) for rule in last]
        entries = []
        for rule, index in expanded:
            ours = rule.ours.format(i=index)
            if ours in our_shapes:
                entries.append(Entry(ours, tuple(name.format(i=index) for name in rule.theirs), rule.transform))
        uncovered = sorted(our_shapes.keys() - {entry.ours for entry in entries} - {tie.copy for tie in our_ties})
        if uncovered:
            raise ValueError(f"{texts.ours} has tensors with no Hugging Face counterpart in this family: "
                             f"{', '.join(uncovered[:4])}. The config describes a model this family cannot hold.")
        stacks = tuple((stack, index) for index in range(num_layers) for stack in stacked)
        return cls(tuple(entries), dict(our_shapes), tuple(our_ties), tuple(their_ties), texts, stacks)

    def expected_hf_shapes(self) -> dict[str, Shape]:
        shapes = {theirs: shape for entry in self.entries
                  for theirs, shape in zip(entry.theirs, entry.transform.hf_shapes(self.our_shapes[entry.ours]))}
        shapes.update({tie.copy: shapes[tie.original] for tie in self.their_ties})
        return shapes

    # --------------------------------------------------------------- Hugging Face -> ours
    def unstacked(self, hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``hf_state`` with every stacked tensor (``Stacked``) split into the per-expert tensors the rules name;
        the other names pass through. A stack of the wrong size leaves names the checks report."""
        state = dict(hf_state)
        for stack, layer in self.stacks:
            tensor = state.pop(stack.stacked.format(i=layer), None)
            if tensor is None:
                continue
            for expert, expert_slice in enumerate(tensor):
                state.update({part.format(i=layer, e=expert): chunk
                              for part, chunk in zip(stack.parts, expert_slice.chunk(len(stack.parts)))})
        return state

    def to_ours(self, hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Our full state dict from a full Hugging Face one (a tied copy may be absent, as on disk; experts may be
        stacked, as ``transformers`` 5 holds them in memory)."""
        state = self.unstacked(hf_state)
        _fill_ties(state, self.their_ties)
        check_names_and_shapes(_shapes(state), self.expected_hf_shapes(), what=self.texts.hf, fix=self.texts.hf_fix)
        for tie in self.their_ties:
            check_tied(state, tie, what="The Hugging Face state dict")
        ours = {entry.ours: entry.transform.to_ours([state[name] for name in entry.theirs]) for entry in self.entries}
        ours.update({tie.copy: ours[tie.original] for tie in self.our_ties})
        return ours

    # --------------------------------------------------------------- ours -> Hugging Face
    def check_ours(self, shapes: Mapping[str, Shape]) -> None:
        """Our names and shapes (of a state dict, or of a checkpoint's index) against the config's model."""
        check_names_and_shapes(shapes, self.our_shapes, what=self.texts.ours, fix=OURS_FIX)

    def hf_tensors(self, entries: Sequence[Entry], read: Callable[[list[str]], Mapping[str, Tensor]]) -> dict[str, Tensor]:
        """The Hugging Face tensors of ``entries``, our tensors read with ``read(names)`` (with the tied copies of
        any original among them, to check the tie); tied Hugging Face copies are left out, as on disk."""
        names = [entry.ours for entry in entries]
        copies = [tie for tie in self.our_ties if tie.original in names]
        tensors = dict(read(names + [tie.copy for tie in copies]))
        for tie in copies:
            check_tied(tensors, tie, what=self.texts.ours)
        hf = {}
        for entry in entries:
            hf.update(zip(entry.theirs, entry.transform.to_hf(tensors.pop(entry.ours))))
        for stack, layer in self.stacks:
            if stack.written:
                stack.stack(hf, layer)
        return hf

    def to_hf(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The full Hugging Face state dict (tied copies included, as ``model.state_dict()`` has them)."""
        self.check_ours(_shapes(state))
        hf = self.hf_tensors(self.entries, lambda names: {name: state[name] for name in names})
        hf.update({tie.copy: hf[tie.original] for tie in self.their_ties})
        return hf

    def plan_shards(self, specs: Mapping[str, Tensor], max_bytes: int) -> list[list[Entry]]:
        """Entries in file order, cut into groups of at most ``max_bytes`` (an entry larger than that alone);
        ``specs`` gives each of our tensors' size (meta tensors will do)."""
        shards: list[list[Entry]] = []
        size = 0
        written = [(stack.part_pattern(layer), layer) for stack, layer in self.stacks if stack.written]
        previous = None
        for entry in self.entries:
            spec = specs[entry.ours]
            nbytes = spec.numel() * spec.element_size()
            # the layer whose written stacks this entry is a part of: never cut between two of its entries
            stack = next((layer for pattern, layer in written if pattern.fullmatch(entry.theirs[0])), None)
            if not shards or (size + nbytes > max_bytes and (stack is None or stack != previous)):
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += nbytes
            previous = stack
        return shards

    def dtype(self, specs: Mapping[str, Tensor]) -> torch.dtype:
        """The dtype of the first entry (the token embedding): what ``config.json`` states as the model's."""
        return specs[self.entries[0].ours].dtype
