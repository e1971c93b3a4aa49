"""Static cost of a compiled kernel, read from its SASS (``cuobjdump -sass``): how many
instructions one element costs, and of which kinds.

The kernels' work is a loop over chunks (the looped kernels, the carry kernels) or one chunk
per program (the step kernel). :func:`costs` counts the body of
the outermost loop (the widest backward branch), or the whole kernel where there is no loop,
and divides by the elements that body covers: ``BT x BD`` per iteration over ``32 x warps``
threads, so "per element" is thread instructions per ``(step, channel)``, the unit of an
issue-bound time estimate (elements x instructions / (SMs x 4 schedulers x 32 lanes x clock)).
The count is static: every instruction in the body once, predicated or not.
"""

from __future__ import annotations

import re
from collections import Counter

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+0x([0-9a-f]+)")


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, text)`` of every instruction in a ``cuobjdump -sass`` listing."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def _unpredicated(text: str) -> str:
    """``@!P0 MUFU.EX2 R1, R2`` -> ``MUFU.EX2 R1, R2``."""
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def opcode(text: str) -> str:
    """``@!P0 MUFU.EX2 R1, R2`` -> ``MUFU.EX2``."""
    return _unpredicated(text).split()[0]


def loop_body(ins: list[tuple[int, str]], last: bool = False) -> tuple[list[str], int]:
    """The outermost loop's instructions (with ``last``, the last of the loops not inside
    another: a kernel of several loops in a row, as the chained forward's two walks and
    look-back; where one loop holds all the others, as a persistent kernel's loop over its
    tickets, the last of those inside it, descending while a single loop holds the rest)
    and how many loops there are (0: the whole kernel)."""
    loops = []
    for addr, text in ins:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:         # a backward branch (not the final self-loop)
            loops.append((int(m.group(1), 16), addr))
    if not loops:
        end = next((a for a, t in ins if opcode(t) == "EXIT"), ins[-1][0])
        return [t for a, t in ins if a <= end or opcode(t) == "EXIT"], 0
    if last:
        inside = loops
        while True:
            outer = [x for x in inside if not any(o != x and o[0] <= x[0] and x[1] <= o[1]
                                                  for o in inside)]
            if len(outer) > 1 or len(inside) == 1:
                break
            inside = [x for x in inside if x != outer[0]]
        lo, hi = max(outer, key=lambda span: span[1])
    else:
        lo, hi = max(loops, key=lambda span: span[1] - span[0])
    return [t for a, t in ins if lo <= a <= hi], len(loops)


_STORES = ("STG", "STS", "STL", "ST.", "ST ", "RED")
_WIDTH = {"64": 2, "128": 4}


def _registers(operand: str) -> set[int]:
    """Registers an operand names; ``R4.64`` (a pair, as 64-bit addresses are) is R4 and R5."""
    out = set()
    for m in re.finditer(r"\bR(\d+)(\.64)?\b", operand):
        base = int(m.group(1))
        out.update((base, base + 1) if m.group(2) else (base,))
    return out


def _reads(text: str) -> set[int]:
    """Registers an instruction reads: every operand but a destination (stores have none)."""
    op, _, rest = _unpredicated(text).partition(" ")
    operands = rest.split(",")
    if not (op + " ").startswith(_STORES):
        operands = operands[1:]
    return set().union(*(_registers(o) for o in operands)) if operands else set()


def _loaded(text: str) -> set[int]:
    """The registers a global load (``LDG``, ``LDG.E``, ``LDG.E.64`` ...; not ``LDGSTS``, which
    copies to shared memory) writes, or an empty set for any other instruction."""
    op = opcode(text)
    if op != "LDG" and not op.startswith("LDG."):
        return set()
    dest = re.search(r"\bR(\d+)\b", _unpredicated(text).split(",")[0])
    if not dest:
        return set()
    width = next((_WIDTH[p] for p in op.split(".") if p in _WIDTH), 1)
    return set(range(int(dest.group(1)), int(dest.group(1)) + width))


def load_use(body: list[str]) -> int | None:
    """The fewest instructions between a global load (``LDG``) in a loop body and the first
    instruction that reads a register it wrote, following the loop round once (a load whose
    value is first used in the next iteration counts the rest of this one too). How long a
    loop's loads can stay in flight before a warp waits on them; ``None`` without a load.
    Static: it is where ptxas scheduled the first use, so a compiler update can move it."""
    shortest = None
    for i, text in enumerate(body):
        regs = _loaded(text)
        if not regs:
            continue
        order = body[i + 1:] + body[:i]
        gap = next((k for k, t in enumerate(order) if regs & _reads(t)), None)
        if gap is not None and (shortest is None or gap < shortest):
            shortest = gap
    return shortest


def costs(sass: str, elements: int, threads: int, last: bool = False) -> dict:
    """Per element: instructions, ``MUFU.EX2``/``LG2``/``RCP``/``RSQ``; per iteration (chunk): barriers,
    shuffles, shared-memory loads and stores, global loads and stores, and the loop's
    :func:`load_use` distance (instructions); ``last``: of the last loop
    (:func:`loop_body`)."""
    body, loops = loop_body(instructions(sass), last)
    ops = Counter(opcode(t) for t in body)
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    per_element = threads / elements
    return dict(
        instr=round(len(body) * per_element, 1),
        ex2=round(count("MUFU.EX2") * per_element, 2),
        lg2=round(count("MUFU.LG2") * per_element, 2),
        rcp=round(count("MUFU.RCP") * per_element, 2),
        rsq=round(count("MUFU.RSQ") * per_element, 2),
        bar=count("BAR"), shfl=count("SHFL"), lds=count("LDS"), sts=count("STS"),
        ldg=count("LDG"), stg=count("STG"), load_use=load_use(body) if loops else None,
        loop=loops > 0,
    )
