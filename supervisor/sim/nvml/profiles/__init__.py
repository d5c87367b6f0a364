"""Built-in simulator node descriptions (YAML files; a package so they ship as package data)."""
