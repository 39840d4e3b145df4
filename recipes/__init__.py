"""The shipped recipes and their data, installed as `miles_async.recipes` (package data: *.toml,
data/*). A recipe names no Python here: this file only makes the folder a package of the wheel.
`miles-async recipes` lists them; `miles-async run NAME` runs one (miles_async/launch/catalog.py)."""
