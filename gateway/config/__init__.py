"""The one frozen configuration: flags, file, environment, rules, server lists, tenants, models."""
