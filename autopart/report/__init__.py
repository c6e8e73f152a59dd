"""Plan reports: `write_html(plan, directory)` writes a self-contained HTML page with the
plan's pipeline timeline, memory, layers, collectives and alternatives as figures
(`autopart report plan.json --html DIR`). Drawing needs matplotlib (the `report`
extra), imported only when a page is written."""

from autopart.report.html import MatplotlibMissing, write_html

__all__ = ["MatplotlibMissing", "write_html"]
