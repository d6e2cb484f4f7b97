"""Reads of the API server's answers bounded in bytes while they stream: no object larger than a cap is ever
held whole, whoever wrote it (docs/security.md: what a stolen token, or anyone, can make large).

A list's answer is one JSON document whose `items` may run to hundreds of MB (100 rules of 1.2 MB each, a
fleet's nodes). `Splitter` cuts the document as its bytes arrive: each element of its top-level `items` is
handed over alone, at most `max_item` bytes, and an element past that is dropped as it streams (counted,
never buffered); the rest of the document (kind, metadata, its continue token) may hold at most
`max_rest` bytes. A watch's events are one JSON document a line: `Lines` hands over each line up to
`max_item` and drops a longer one the same way.

Only the structure is scanned here, by a regular expression that jumps from one bracket or quote to the
next, so a large item costs a few regex calls, not a Python step per byte; the items themselves are parsed
by `json.loads`. A document that is not JSON comes out as one `json.loads` would refuse.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# Outside a string: a quote or a bracket; inside one: its end or an escape.
_STRUCTURE = re.compile(rb'["{}\[\]]')
_IN_STRING = re.compile(rb'["\\]')
_ITEMS = b"items"


class TooLarge(ValueError):
    """The part of an answer that must be kept whole is larger than its cap."""


class Splitter:
    """Feed a JSON document's bytes with `feed` (each returns the items completed by them), then `end()` for
    the document with `"items": []` in place of its elements. `dropped`: the elements over `max_item`."""

    def __init__(self, *, max_item: int, max_rest: int) -> None:
        self._max_item, self._max_rest = max_item, max_rest
        self._rest: list[bytes] = []
        self._rest_size = 0
        self._item: list[bytes] = []
        self._item_size = 0
        self._depth = 0
        self._in_string = self._escape = False
        self._key: bytes | None = b""  # the last string of the top level, while short (None: too long)
        self._items_open = False  # inside the top-level "items" array
        self._in_item = self._oversized = False
        self.dropped = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        done: list[bytes] = []
        i, start, n = 0, 0, len(chunk)
        while i < n:
            if self._in_string:
                if self._escape:
                    self._escape = False
                    i += 1
                    continue
                m = _IN_STRING.search(chunk, i)
                if m is None:
                    self._grow_key(chunk[i:])
                    i = n
                    break
                if chunk[m.start()] == 0x5C:  # a backslash: the next byte is escaped
                    self._grow_key(chunk[i : m.end()])
                    self._escape = True
                    i = m.end()
                    continue
                self._grow_key(chunk[i : m.start()])
                self._in_string = False
                i = m.end()
                continue
            m = _STRUCTURE.search(chunk, i)
            if m is None:
                break
            c, at = chunk[m.start()], m.start()
            i = m.end()
            if c == 0x22:  # a quote
                self._in_string = True
                if self._depth == 1:
                    self._key = b""
                continue
            if c in {0x7B, 0x5B}:  # { [
                self._depth += 1
                if self._depth == 2 and c == 0x5B and self._key == _ITEMS:
                    self._items_open = True
                    self._to_rest(chunk[start:i])
                    start = i
                elif self._depth == 3 and self._items_open:
                    # An element begins: what lay between elements (commas, blanks) is left out.
                    self._in_item, self._oversized = True, False
                    self._item, self._item_size = [], 0
                    start = at
                continue
            self._depth -= 1  # } ]
            if self._in_item and self._depth == 2:
                self._to_item(chunk[start:i])
                start = i
                self._in_item = False
                if self._oversized:
                    self.dropped += 1
                else:
                    done.append(b"".join(self._item))
                self._item = []
            elif self._items_open and self._depth == 1:
                self._items_open = False
                start = at  # the closing bracket goes to the rest
        if self._in_item:
            self._to_item(chunk[start:])
        elif not self._items_open:
            self._to_rest(chunk[start:])
        return done

    def end(self) -> bytes:
        """The document without its elements; TooLarge when that part was past `max_rest`."""
        return b"".join(self._rest)

    def _grow_key(self, part: bytes) -> None:
        if self._depth == 1 and self._key is not None:
            self._key = self._key + part if len(self._key) + len(part) <= len(_ITEMS) else None

    def _to_rest(self, part: bytes) -> None:
        self._rest_size += len(part)
        if self._rest_size > self._max_rest:
            raise TooLarge(f"more than {self._max_rest} bytes besides the items")
        self._rest.append(part)

    def _to_item(self, part: bytes) -> None:
        if self._oversized:
            return
        self._item_size += len(part)
        if self._item_size > self._max_item:
            self._oversized = True
            self._item = []
            return
        self._item.append(part)


class Dropped(bytes):
    """In `Lines`' output, in place of a line over the cap: its first `Lines.HEAD` bytes, where the API
    server puts the event's type and the object's name and resourceVersion (`dropped_event`)."""


class Lines:
    """A watch's stream cut into lines of at most `max_item` bytes, in order; a longer line is dropped as it
    streams, never buffered past the cap, and comes out as its `Dropped` head."""

    HEAD = 4096

    def __init__(self, *, max_item: int) -> None:
        self._max = max_item
        self._buffer = b""
        self._skipping = False

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        while chunk:
            cut = chunk.find(b"\n")
            if cut < 0:
                if not self._skipping:
                    self._buffer += chunk
                    if len(self._buffer) > self._max:
                        head, self._buffer, self._skipping = self._buffer[: self.HEAD], b"", True
                        yield Dropped(head)
                return
            line, chunk = chunk[:cut], chunk[cut + 1 :]
            if self._skipping:
                self._skipping = False
                continue
            line, self._buffer = self._buffer + line, b""
            if len(line) > self._max:
                yield Dropped(line[: self.HEAD])
            elif line.strip():
                yield line


# Where the API server puts them: the event's object's metadata first, its name first in that.
_DROPPED_NAME = re.compile(rb'"metadata":\{"name":"([^"\\]{1,253})"')
_DROPPED_RV = re.compile(rb'"resourceVersion":"([0-9]{1,20})"')


def dropped_event(head: bytes) -> dict[str, Any] | None:
    """What a dropped watch line's head says of its object: a DROPPED event, or None when it names none."""
    name, rv = _DROPPED_NAME.search(head), _DROPPED_RV.search(head)
    if name is None:
        return None
    meta = {"name": name.group(1).decode(errors="replace")}
    if rv is not None:
        meta["resourceVersion"] = rv.group(1).decode()
    return {"type": "DROPPED", "object": {"metadata": meta}}
