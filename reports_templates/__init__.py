"""The jinja2 templates and the JSON schema of the reports (data files; found by
diag.foundations.environment.templates_dir).

A regular package, not a folder of data only: the editable install's finder maps ``diag.reports_templates``
to this folder only when it holds an ``__init__.py`` (setuptools resolves no nested namespace package).
"""
