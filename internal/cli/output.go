package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"
)

// Output formats of -o/--output. The default, text, is the human table; json and yaml carry the
// same facts under field names that are stable (README.md of this package lists them).
const (
	outputText = "text"
	outputJSON = "json"
	outputYAML = "yaml"
)

// outputFormat is the value of -o/--output. It refuses an unknown format while the flags are
// parsed, so that `-o xml` is a usage error (exit 2) like any other bad flag.
type outputFormat string

func (o *outputFormat) String() string {
	if *o == "" {
		return outputText
	}
	return string(*o)
}

func (o *outputFormat) Set(s string) error {
	switch s {
	case outputText, outputJSON, outputYAML:
		*o = outputFormat(s)
		return nil
	}
	return fmt.Errorf("unknown output format %q: want %s", s, strings.Join([]string{outputText, outputJSON, outputYAML}, ", "))
}

func (o *outputFormat) Type() string { return "format" }

// structured reports whether the output is JSON or YAML rather than the human table.
func (o *outputFormat) structured() bool { return *o == outputJSON || *o == outputYAML }

// addOutputFlag adds -o/--output to fs.
func addOutputFlag(fs *pflag.FlagSet, o *outputFormat) {
	*o = outputText
	fs.VarP(o, "output", "o", "output format: text (a table for people), json or yaml (stable field names for scripts)")
}

// encode writes v to out as JSON (indented, one document) or YAML.
func (o *outputFormat) encode(out io.Writer, v any) error {
	switch *o {
	case outputJSON:
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(v); err != nil {
			return fmt.Errorf("encoding JSON output: %w", err)
		}
		return nil
	case outputYAML:
		data, err := yaml.Marshal(v)
		if err != nil {
			return fmt.Errorf("encoding YAML output: %w", err)
		}
		_, err = out.Write(data)
		if err != nil {
			return fmt.Errorf("writing output: %w", err)
		}
		return nil
	}
	return fmt.Errorf("encoding output: format %q has no encoding", o.String())
}
