// The official TypeScript MCP SDK as a client, through Sandgate (tests/integration/test_mcp.py).
//   node client.mjs URL STEPS_JSON     (HTTPS_PROXY with identity:token, SSL_CERT_FILE: the CA)
// STEPS_JSON: [["list"], ["call", NAME, {ARGS}], ...]; one JSON line per step, as client.py.
import { readFileSync } from "node:fs";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { McpError } from "@modelcontextprotocol/sdk/types.js";
import { ProxyAgent, fetch as undiciFetch } from "undici";

const [url, stepsJson] = process.argv.slice(2);
const proxy = new URL(process.env.HTTPS_PROXY);
const auth = Buffer.from(
  `${decodeURIComponent(proxy.username)}:${decodeURIComponent(proxy.password)}`).toString("base64");
const dispatcher = new ProxyAgent({
  uri: `${proxy.protocol}//${proxy.host}`,
  token: `Basic ${auth}`,
  requestTls: { ca: readFileSync(process.env.SSL_CERT_FILE) },
});
const transport = new StreamableHTTPClientTransport(new URL(url), {
  fetch: (input, init) => undiciFetch(input, { ...init, dispatcher }),
});
const client = new Client({ name: "sandgate-test", version: "1.0.0" });
await client.connect(transport);
for (const step of JSON.parse(stepsJson)) {
  let out;
  try {
    if (step[0] === "list") {
      const r = await client.listTools();
      out = { tools: r.tools.map((t) => t.name).sort() };
    } else {
      const r = await client.callTool({ name: step[1], arguments: step[2] });
      out = { text: r.content.map((c) => c.text ?? "").join(" "), is_error: !!r.isError };
    }
  } catch (e) {
    if (!(e instanceof McpError)) throw e;
    out = { error: e.message, code: e.code, data: e.data };
  }
  console.log(JSON.stringify(out));
}
await transport.terminateSession().catch(() => {});
await client.close();
