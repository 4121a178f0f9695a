"""Reports over slotwise's timing records and llama-server's own log.

parse (records.py, serverlog.py, tasks.py) -> aggregate (tables.py, record_tables.py,
task_tables.py, timeline.py) -> render (render.py, render_html.py, timeline_*.py); cli.py wires them.
"""
