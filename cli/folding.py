"""Tables that fold to fit the terminal, whatever its width.

A :class:`FoldingTable` is laid out when it is printed, for the width it is given. While
every column fits, each is drawn whole in its own place. When they do not, the column
that matters least *folds*: its values move into the cell of a column that stays (its
``into``, else the table's host column), as ``label value`` parts after that cell's own
value, and the table is measured again; one column at a time, until it fits. Nothing is
hidden and nothing is cut: a column is never drawn narrower than its minimum (a
``whole`` column, such as a run id, a state or a time, never narrower than its widest
value), and a folded value is packed whole onto a line of its host whenever the host is
that wide.

The same table therefore reads well at 60 columns and at 250, with no threshold between
two layouts; ``--wide`` prints it at its natural width, where nothing folds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Mapping, Sequence

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

SEPARATOR = " · "  #: between the folded parts packed on one line of a host cell
LABEL_STYLE = "dim"
#: A wrapping column is kept as wide as its longest word, up to this many columns while the
#: terminal allows (its comfortable width), and up to the second number at any width.
WORD_CAP, HARD_WORD_CAP = 24, 16


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a :class:`FoldingTable`.

    Attributes:
        name: the header.
        keep: how long the column stays in its own place as the width shrinks: the
            lowest ``keep`` folds first. A column with no standing column to fold into
            never folds.
        whole: its values never wrap: it is as wide as its widest value (ids, states,
            counts, times). Otherwise its values wrap, down to ``min_width``.
        min_width: the narrowest a wrapping column (or a column holding folded values)
            is ever drawn.
        comfort: the width below which a wrapping column reads badly: less kept columns
            fold to give it that much while the terminal allows (None: ``min_width``).
        into: where its values go when it folds: the first of these columns still
            standing, else the table's host.
        label: the word shown before a folded value (``key acme``); None: the column's
            name; ``""``: the value alone.
        host_name: the header of this column while it holds folded values (None: its name).
        justify: ``left`` or ``right``.
        always: drawn even when every value is empty (else such a column is left out).
        quiet: values that say nothing once folded (``-``; a count of ``0``): left out there.
    """

    name: str
    keep: int = 0
    whole: bool = False
    min_width: int = 10
    into: tuple[str, ...] = ()
    label: str | None = None
    comfort: int | None = None
    host_name: str | None = None
    justify: str = "left"
    always: bool = False
    quiet: tuple[str, ...] = ("-",)


@dataclasses.dataclass(frozen=True)
class Cell:
    """A cell drawn as ``show`` (a progress bar, say) in its own column and as ``text``
    when its column folds into another."""

    show: RenderableType
    text: Text


def _as_text(value: Any) -> Text:
    if value is None:
        return Text("")
    if isinstance(value, Text):
        return value
    if isinstance(value, Cell):
        return value.text
    return Text(str(value))


def _empty(value: Any) -> bool:
    return _as_text(value).plain.strip() == ""


def _text_width(text: Text) -> int:
    return max((cell_len(line) for line in text.plain.split("\n")), default=0)


def _longest_word(text: str) -> int:
    return max((cell_len(word) for word in text.split()), default=0)


@dataclasses.dataclass
class _Measure:
    """A column's widest value and longest word, and per row the width of its value
    once folded (0: nothing shown), with the longest word of those."""

    own: int = 0
    word: int = 0
    parts: list[int] = dataclasses.field(default_factory=list)
    part_word: int = 0


class FoldingTable:
    """A rich renderable: a table of ``rows`` (mappings of column name to a value: a
    ``str``, a :class:`~rich.text.Text`, a :class:`Cell` or None) laid out for the width
    it is printed at (see the module docstring).

    Args:
        columns: the columns, in the order they are drawn.
        rows: the rows.
        host: the column a folding column goes to when none of its ``into`` stands.
        title: the table's title, if any.
    """

    def __init__(self, columns: Sequence[Column], rows: Iterable[Mapping[str, Any]], *, host: str,
                 title: str | None = None) -> None:
        self.rows = [dict(row) for row in rows]
        self.columns = [c for c in columns if c.always or c.name == host or
                        any(not _empty(row.get(c.name)) for row in self.rows)]
        names = [c.name for c in self.columns]
        if host not in names:
            raise ValueError(f"the host column {host!r} is not one of the columns")
        self.host = host
        self.title = title

    # -- the layout --------------------------------------------------------------------------------

    def _target(self, column: Column, standing: list[Column]) -> Column | None:
        names = {c.name: c for c in standing if c is not column}
        for name in (*column.into, self.host):
            if name in names:
                return names[name]
        return None

    def _measures(self, console: Console, options: ConsoleOptions) -> dict[str, _Measure]:
        """Each column's widths, measured once per layout."""
        out = {}
        for column in self.columns:
            measure = _Measure()
            label = column.name if column.label is None else column.label
            for row in self.rows:
                value = row.get(column.name)
                text = _as_text(value)
                if isinstance(value, Cell):
                    measure.own = max(measure.own, Measurement.get(console, options, value.show).maximum)
                else:
                    measure.own = max(measure.own, _text_width(text))
                measure.word = max(measure.word, _longest_word(text.plain))
                shown = text.plain.strip()
                part = 0 if shown == "" or shown in column.quiet else text.cell_len + (len(label) + 1 if label else 0)
                measure.parts.append(part)
            measure.part_word = max(measure.word, _longest_word(label))
            out[column.name] = measure
        return out

    def _held(self, column: Column, guests: dict[str, list[Column]]) -> list[Column]:
        """The columns folded into ``column``, and those folded into them."""
        held = []
        for guest in guests.get(column.name, []):
            held += [guest, *self._held(guest, guests)]
        return held

    def _widths(self, measures: dict[str, _Measure], standing: list[Column], guests: dict[str, list[Column]],
                comfortable: bool) -> dict[str, tuple[int, int]]:
        """``{column: (narrowest, natural)}`` of the standing columns, values included: a
        wrapping column (or one holding folded values) at its comfortable width, or at
        its minimum, or less when its values need less."""
        out: dict[str, tuple[int, int]] = {}
        for column in standing:
            held = self._held(column, guests)
            header = column.host_name or column.name if held else column.name
            measure = measures[column.name]
            own, word = max(measure.own, cell_len(header)), max(measure.word, _longest_word(header))
            folded = 0
            if held:
                word = max([word, *(measures[c.name].part_word for c in held)])
                columns = [measures[c.name].parts for c in held]
                for parts in zip(*columns):
                    shown = [p for p in parts if p]
                    folded = max(folded, sum(shown) + len(SEPARATOR) * max(0, len(shown) - 1))
            natural = max(own, folded)
            least = (max(column.comfort or column.min_width, column.min_width, min(word, WORD_CAP)) if comfortable
                     else max(column.min_width, min(word, HARD_WORD_CAP)))
            if column.whole and not held:
                out[column.name] = (own, natural)
            elif column.whole:  # its own values stay whole, its guests' wrap
                out[column.name] = (max(own, min(least, natural)), natural)
            else:
                out[column.name] = (min(natural, least), natural)
        return out

    def _parts(self, row: Mapping[str, Any], guests: dict[str, list[Column]], column: Column) -> list[Text]:
        """The folded parts of ``row`` that ``column`` holds (its guests' and theirs), in
        the order their columns are drawn."""
        parts: list[Text] = []
        for guest in guests.get(column.name, []):
            value = row.get(guest.name)
            if not _empty(value) and _as_text(value).plain.strip() not in guest.quiet:
                label = guest.name if guest.label is None else guest.label
                part = Text(f"{label} ", style=LABEL_STYLE) if label else Text("")
                part.append_text(_as_text(value))
                parts.append(part)
            parts.extend(self._parts(row, guests, guest))
        return parts

    @staticmethod
    def _overhead(n: int) -> int:
        return 3 * n + 1  # a space each side of every cell, and n + 1 rules

    def _plan(self, console: Console, options: ConsoleOptions, width: int
              ) -> tuple[list[Column], dict[str, list[Column]], dict[str, tuple[int, int, int]]]:
        """Which columns fold at ``width``: the least kept fold, one at a time, while the
        table does not fit with its wrapping columns at their comfortable widths; a column
        kept at least as long as the host folds only while the table does not fit at all.
        Returns the standing columns, who holds whom, and each standing column's
        ``(minimum, comfortable, natural)`` widths."""
        standing = list(self.columns)
        guests: dict[str, list[Column]] = {}
        host_keep = next(c.keep for c in self.columns if c.name == self.host)
        measures = self._measures(console, options)
        while True:
            ranges = self._ranges(measures, standing, guests)
            overhead = self._overhead(len(standing))
            if sum(r[1] for r in ranges.values()) + overhead <= width:
                return standing, guests, ranges
            foldable = [c for c in standing if self._target(c, standing) is not None]
            if not foldable:
                return standing, guests, ranges
            folding = min(foldable, key=lambda c: c.keep)
            if folding.keep >= host_keep and sum(r[0] for r in ranges.values()) + overhead <= width:
                return standing, guests, ranges
            target = self._target(folding, standing)
            assert target is not None
            guests.setdefault(target.name, []).append(folding)
            guests[target.name].sort(key=self.columns.index)
            standing.remove(folding)

    def _ranges(self, measures: dict[str, _Measure], standing: list[Column],
                guests: dict[str, list[Column]]) -> dict[str, tuple[int, int, int]]:
        hard = self._widths(measures, standing, guests, False)
        comfort = self._widths(measures, standing, guests, True)
        return {name: (low, comfort[name][0], high) for name, (low, high) in hard.items()}

    def _distribute(self, ranges: dict[str, tuple[int, int, int]], standing: list[Column], width: int
                    ) -> dict[str, int]:
        """Each standing column's width: its minimum; then, of what is left, a share (in
        proportion to what each lacks) up to its comfortable width; then up to its natural
        width."""
        widths = {name: low for name, (low, _, _) in ranges.items()}
        spare = width - sum(widths.values()) - self._overhead(len(standing))
        for stage in (1, 2):
            while spare > 0:
                wanting = {name: r[stage] - widths[name] for name, r in ranges.items() if r[stage] > widths[name]}
                if not wanting:
                    break
                total = sum(wanting.values())
                given = 0
                for name, want in sorted(wanting.items(), key=lambda item: -item[1]):
                    share = min(want, max(1, spare * want // total), spare - given)
                    widths[name] += share
                    given += share
                    if given >= spare:
                        break
                spare -= given
                if given == 0:
                    break
        return widths

    def _cell(self, row: Mapping[str, Any], column: Column, guests: dict[str, list[Column]], width: int) -> Any:
        own = row.get(column.name)
        parts = self._parts(row, guests, column)
        if not parts:
            return "" if own is None else own.show if isinstance(own, Cell) else _as_text(own)
        lines: list[Text] = []
        for part in parts:  # pack whole parts onto lines as wide as the column
            if lines and lines[-1].cell_len + len(SEPARATOR) + part.cell_len <= width:
                lines[-1].append(SEPARATOR, style=LABEL_STYLE)
                lines[-1].append_text(part)
            else:
                lines.append(part.copy())
        folded = Text("\n").join(lines)
        if _empty(own):
            return folded
        if isinstance(own, Cell):
            return Group(own.show, folded)
        text = _as_text(own).copy()
        text.append("\n")
        text.append_text(folded)
        return text

    def layout(self, console: Console, options: ConsoleOptions) -> Table:
        """The rich table for ``options.max_width`` columns."""
        width = options.max_width
        standing, guests, ranges = self._plan(console, options, width)
        widths = self._distribute(ranges, standing, width)
        table = Table(title=self.title, title_justify="left")
        for column in standing:
            hosting = bool(guests.get(column.name))
            table.add_column(column.host_name if hosting and column.host_name else column.name,
                             width=widths[column.name], no_wrap=column.whole and not hosting,
                             overflow="fold", justify=column.justify)  # type: ignore[arg-type]
        for row in self.rows:
            table.add_row(*(self._cell(row, c, guests, widths[c.name]) for c in standing))
        return table

    # -- rich's protocol ---------------------------------------------------------------------------

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Table]:
        yield self.layout(console, options)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        """Narrowest: every column that can fold folded; widest: none folded."""
        everything = self._widths(self._measures(console, options), list(self.columns), {}, False)
        widest = sum(high for _, high in everything.values()) + self._overhead(len(self.columns))
        standing, _, ranges = self._plan(console, options, 0)  # (fits nowhere: the most folded)
        narrowest = sum(low for low, _, _ in ranges.values()) + self._overhead(len(standing))
        return Measurement(min(narrowest, widest), widest)
