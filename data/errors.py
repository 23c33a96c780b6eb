"""The one error bad input data raises, located by file, column and row or line."""

from __future__ import annotations


class DataValidationError(ValueError):
    """Input data that breaks the schema contract, with where it went wrong."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        column: str | None = None,
        row: int | None = None,
        line: int | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.column = column
        self.row = row
        self.line = line
        super().__init__(str(self))

    def __str__(self) -> str:
        where = []
        if self.column is not None:
            where.append(f"column {self.column!r}")
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.line is not None:
            where.append(f"line {self.line}")
        text = f"{', '.join(where)}: {self.message}" if where else self.message
        return f"{self.file}: {text}" if self.file is not None else text

    def __reduce__(self) -> tuple:
        """Pickle with the keyword-only location, so errors cross process boundaries intact."""
        return (_rebuild, (self.message, self.file, self.column, self.row, self.line))


def _rebuild(
    message: str, file: str | None, column: str | None, row: int | None, line: int | None
) -> DataValidationError:
    return DataValidationError(message, file=file, column=column, row=row, line=line)
