"""Layer 5, figures: how a chapter draws what it measured (plotly, matplotlib, seaborn).

A figure function takes plain data (tables, dicts, arrays, numbers) and returns the figure; it computes no claim
and decides nothing, so a chapter's finding function keeps its numbers and verdicts and only hands them over to be
drawn. One module per chapter that draws, ``panels.py`` for what two chapters draw alike. Plotting libraries are
imported inside the functions: importing a chapter stays cheap. Imports only from the layers below (never
``chapters`` or ``book``).
"""
