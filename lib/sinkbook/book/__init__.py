"""Layer 6, the book: results files and the claims summary, display, the explorer, the build and the command
line. The top layer: nothing else imports from it."""
