"""Renderings of results: terminal tables (rich) and self-contained HTML pages. Import no engine."""
