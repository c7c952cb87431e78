"""`gpuid-agent history`: which physical GPU and chassis sat under which node and pod, when.

It reads the records the fleet's exporters stored — the PostgreSQL tables (`postgres_source`),
the S3 layout through DuckDB (`s3_source`), or a directory of the stdout exporter's JSON lines
(`records_dir`) — as facts (`facts`): sightings (readings), holdings (allocations, with their
GPU-seconds and energy), marks (health transitions, XIDs, replacements) and usage amounts.
`questions` turns them into the answers (`answers`) of the four questions, and the renderers
print them: an aligned table (`render_table`), JSON and CSV (`render_data`), or one
self-contained HTML page with a timeline (`render_html` over `timeline`).

A tool of its own on top of the package: it reads records and the settings that say where
they are, never the running agent, and nothing in the agent imports it.
"""
