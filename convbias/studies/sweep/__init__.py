"""Sample-efficiency and parameter sweeps over train.py: the sweep file (`spec`), running and collecting the grid
(`sweep`), the runs CSV as the report reads it (`runs`), the report's tables and figures (`report`, `figures`) and
`convbias-sweep` (`command`)."""
