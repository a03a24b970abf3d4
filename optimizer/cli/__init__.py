"""The edge: flags -> one StudyConfig -> the library -> print; one module per subcommand."""
