"""Private building blocks every layer stands on: text rules, JSON at any depth, the
worker's connections, cancellable calls, encryption at rest. Not a public surface: names here
may change in any release."""
