"""kvpool dev tooling, a distribution of its own (`kvpool-dev`, dev/ in a kvpool checkout).

  kvpool_dev.testbed   local stand-ins for a fleet's parts (models, Redis, S3, vLLM, router)
  kvpool_dev.bench     `kvpool bench store|e2e|fleet`
  kvpool_dev.demo      `kvpool demo` (`make demo`)
  kvpool_dev.golden    golden renders of examples/ (`make golden`, `kvpool-operator golden`)
  kvpool_dev.apidoc    the API reference in docs/operator.md

Never installed in images and never imported by kvpool_connector or kvpool_operator: their CLIs
name these modules as strings and import them only when a dev command runs.
Install: `pip install -e ./dev` from a kvpool checkout (scripts/setup.sh does).
"""
