"""Markdown output shared by the kernel tools and the benchmarks (which import it from here)."""


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
