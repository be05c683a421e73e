// Regenerate the wire contract's code into a temporary directory and fail if it
// differs from the committed src/gen.
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";

const root = new URL("..", import.meta.url).pathname;
const work = mkdtempSync(join(tmpdir(), "baton-gen-"));
const template = join(work, "buf.gen.yaml");
writeFileSync(
  template,
  readFileSync(join(root, "buf.gen.yaml"), "utf8")
    .replace("local: node_modules/.bin/protoc-gen-es", `local: ${join(root, "node_modules/.bin/protoc-gen-es")}`)
    .replace("out: src/gen", `out: ${join(work, "gen")}`),
);

/** Every file under `dir`, relative to it. */
function files(dir) {
  return readdirSync(dir, { recursive: true })
    .map((name) => join(dir, name))
    .filter((path) => statSync(path).isFile())
    .map((path) => relative(dir, path))
    .sort();
}

try {
  execFileSync(join(root, "node_modules/.bin/buf"), ["generate", join(root, "../../kernel/proto"), "--template", template], {
    cwd: root,
    stdio: "inherit",
  });
  const fresh = join(work, "gen");
  const kept = join(root, "src/gen");
  const names = [...new Set([...files(fresh), ...files(kept)])];
  const stale = names.filter((name) => {
    try {
      return readFileSync(join(fresh, name), "utf8") !== readFileSync(join(kept, name), "utf8");
    } catch {
      return true;
    }
  });
  if (stale.length) {
    console.error(`src/gen is out of date (run npm run generate): ${stale.join(", ")}`);
    process.exitCode = 1;
  } else {
    console.log("src/gen matches kernel/proto");
  }
} finally {
  rmSync(work, { recursive: true, force: true });
}
