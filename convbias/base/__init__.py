"""The bottom layer, which every other part of the package may use and which imports none of them: the
package's errors and their exit codes (`errors`), untrusted reads (`inputs`), owned and atomic writes
(`storage`), weight files (`weights`), a model family's record (`family`), tables (`tables`), the argparse
pieces every command shares (`command_line`) and the one use of timm's
private API (`timm_compat`)."""
